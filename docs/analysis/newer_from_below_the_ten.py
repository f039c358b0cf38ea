"""Newer disagreeing statements pulled into the first ten from places 11-15 or 11-20.

Offline analysis behind the thirteenth part of issue 17 in docs/benchmarks.md. The built rule
(crates/mnemo-recall/src/restated.rs) reorders only the first ten: of two rows of one writer
whose event times differ, whose numbers differ and whose vectors' cosine is at least 0.6, the
newer goes just above the older. Two of BEAM's updates it cannot reach sit 12th and 19th. This
script tries, before or after that rule, pulling a newer row from places 11-N up to just above
an older row of the first ten it disagrees with (the rows below shift down one; the tenth
leaves). Nothing here is built into mnemo.

Inputs, from the kept bench databases of the current build:
  1. mnemo-bench locomo --signals off --k 1,5,10,20 --database-url URL --dump locomo.jsonl
     mnemo-bench beam --signals off --k 1,5,10,20 --database-url URL --dump beam.jsonl
  2. For each database, one line per embedded row:
     psql URL -At -F $'\\t' -c "select i.tenant_id, i.source_ref,
         coalesce(nullif(i.tool_name, ''), i.metadata->>'name', i.role), extract(epoch from i.event_time),
         i.created_at, replace(i.content, E'\\n', ' '), e.embedding::text
       from memory_items i join memory_embeddings e on e.item_id = i.id and e.tenant_id = i.tenant_id"
       > rows.tsv
     (tenant, source_ref, the writer, event time, created, content, vector).

Run: python3 newer_from_below_the_ten.py locomo.jsonl locomo-rows.tsv beam.jsonl beam-rows.tsv
"""

import json
import math
import re
import sys

NUMBER = re.compile(r"\d[\d,.:]*")


def numbers(text):
    return {n.rstrip(".,:") for n in NUMBER.findall(text)}


def load(path):
    rows = {}
    for line in open(path):
        tenant, ref, writer, ts, _created, content, emb = line.rstrip("\n").split("\t")
        v = [float(x) for x in emb.strip("[]").split(",")]
        norm = math.sqrt(sum(x * x for x in v))
        rows[(tenant, ref)] = dict(writer=writer, ts=float(ts), content=content, vec=[x / norm for x in v])
    return rows


def disagree(older, newer):
    a, b = numbers(older["content"]), numbers(newer["content"])
    cosine = sum(x * y for x, y in zip(older["vec"], newer["vec"]))
    return older["writer"] == newer["writer"] and newer["ts"] > older["ts"] and a and b and a != b and cosine >= 0.6


def within_ten(found, rows, tenant):
    """The built rule: in the first ten, the newer of a disagreeing pair goes just above the older."""
    top, moved = list(found[:10]), True
    while moved:
        moved = False
        for a in range(len(top)):
            for b in range(a + 1, len(top)):
                if disagree(rows[(tenant, top[a])], rows[(tenant, top[b])]):
                    top.insert(a, top.pop(b))
                    moved = True
                    break
            if moved:
                break
    return top + list(found[10:])


def pulled_in(found, rows, tenant, depth):
    found = list(found)
    for b in range(10, min(depth, len(found))):
        for a in range(10):
            if disagree(rows[(tenant, found[a])], rows[(tenant, found[b])]):
                found.insert(a, found.pop(b))
                break
    return found


def score(locomo, locomo_rows, beam, beam_rows, order):
    recall = {k: [] for k in (1, 5, 10)}
    for q in locomo:
        if q["category"] == 5 or not q["gold"]:
            continue
        f = order(q["found"], locomo_rows, q["tenant"])
        for k in recall:
            recall[k].append(len(set(f[:k]) & set(q["gold"])) / len(set(q["gold"])))
    above, both, first = [], [], []
    for q in beam:
        f = order(q["found"], beam_rows, q["tenant"])
        if q["kind"] == "knowledge_update":
            u = min((f.index(x) for x in q["updated"] if x in f), default=None)
            o = min((f.index(x) for x in q["original"] if x in f), default=None)
            above.append(u is not None and (o is None or u < o))
            first.append(u == 0)
        elif q["kind"] == "contradiction":
            both.append(any(x in f[:10] for x in q["first"]) and any(x in f[:10] for x in q["second"]))
    mean = lambda xs: sum(xs) / len(xs)
    return (f"LoCoMo R@1 {mean(recall[1]):.3f} R@5 {mean(recall[5]):.3f} R@10 {mean(recall[10]):.3f} | "
            f"BEAM above {mean(above):.2f} both contradicting@10 {mean(both):.2f} updated@1 {mean(first):.2f}")


def main():
    locomo = [json.loads(l) for l in open(sys.argv[1])]
    locomo_rows = load(sys.argv[2])
    beam = [json.loads(l) for l in open(sys.argv[3])]
    beam_rows = load(sys.argv[4])
    variants = {"as built (within the ten)": within_ten}
    for depth in (15, 20):
        variants[f"within the ten, then pulled in from 11-{depth}"] = (
            lambda d: lambda f, r, t: pulled_in(within_ten(f, r, t), r, t, d))(depth)
        variants[f"pulled in from 11-{depth}, then within the ten"] = (
            lambda d: lambda f, r, t: within_ten(pulled_in(f, r, t, d), r, t))(depth)
    for name, order in variants.items():
        print(f"{name:<45} {score(locomo, locomo_rows, beam, beam_rows, order)}")


if __name__ == "__main__":
    main()
