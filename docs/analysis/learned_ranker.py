"""A learned ranker over recall's candidates, estimated on conversations it was not trained on.

Offline analysis behind "A learned ranker over the candidates" in docs/benchmarks.md (issue 17).
It asks whether a ranker trained on LoCoMo could order recall's candidates better than RRF, and
scores every variant by leave-one-conversation-out: trained on four of locomo-dev5's
conversations, measured on the fifth, five times. Nothing here is built into mnemo.

Inputs (a LoCoMo bench database of the current build):
  1. In a git worktree, `git apply docs/analysis/dump-lists.patch` and build `mnemo-bench`; then
       MNEMO_DUMP_LISTS=lists.jsonl mnemo-bench locomo --signals off --k 1,5,10,20 \
           --database-url URL --dump dump.jsonl
     The patched recall appends, for each hybrid question, its vector, the keyword, vector and
     period lists and the fused order; `--dump` gives each question's category and gold turns.
  2. psql URL -At -F $'\\t' -c "select i.id, i.tenant_id, i.source_ref,
       coalesce(i.metadata->>'name', ''), extract(epoch from i.event_time),
       coalesce(i.token_count, 0), e.embedding::text from memory_items i join memory_embeddings e
       on e.item_id = i.id and e.tenant_id = i.tenant_id" > rows.tsv

Run: python3 learned_ranker.py lists.jsonl dump.jsonl rows.tsv   (numpy and scikit-learn)
"""

import json
import math
import re
import sys

import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression

LIST_RRF_K = 10.0  # as in crates/mnemo-recall/src/fusion.rs


def load(lists_path, dump_path, rows_path):
    rows, by_ref = {}, {}
    for line in open(rows_path):
        id_, tenant, ref, name, t, tokens, emb = line.rstrip("\n").split("\t")
        session, turn = map(int, re.match(r"D(\d+):(\d+)", ref).groups())
        row = dict(ref=ref, tokens=int(tokens), v=np.array(json.loads(emb), dtype=np.float32),
                   session=session, turn=turn)
        rows[id_] = row
        by_ref[(tenant, ref)] = row
    questions = []
    for lists_line, dump_line in zip(open(lists_path), open(dump_path)):
        lists, dump = json.loads(lists_line), json.loads(dump_line)
        assert lists["query"] == dump["question"], "the two files must come from one run"
        q = np.array(lists["vector"], dtype=np.float32)
        tenant = lists["tenant"]
        rr = {name: {u: 1.0 / (LIST_RRF_K + i + 1) for i, u in enumerate(lists[name].get("Session", []))}
              for name in ("keyword", "nearest", "within")}
        candidates = [u for u, _ in lists["fused"]]
        cos = {u: float(rows[u]["v"] @ q) for u in candidates}
        by_session = {}
        for u in candidates:
            by_session.setdefault(rows[u]["session"], []).append(cos[u])
        session_rel = {s: np.mean(sorted(c, reverse=True)[:3]) for s, c in by_session.items()}

        def neighbour_cos(u, step):
            r = rows[u]
            n = by_ref.get((tenant, f"D{r['session']}:{r['turn'] + step}"))
            return float(n["v"] @ q) if n else cos[u]

        x = []
        for rank, u in enumerate(candidates):
            x.append([rr["keyword"].get(u, 0.0), rr["nearest"].get(u, 0.0), rr["within"].get(u, 0.0),
                      cos[u], neighbour_cos(u, 1), neighbour_cos(u, -1), session_rel[rows[u]["session"]],
                      math.log1p(rows[u]["tokens"]), 1.0 / (60 + rank + 1),
                      float(u in rr["keyword"]), float(u in rr["nearest"])])
        x = np.array(x)
        top = x[:, 3].max()  # the same similarities relative to the question's best candidate
        x = np.hstack([x, np.stack([x[:, 3] - top, x[:, 4] - top, x[:, 5] - top, x[:, 6] - x[:, 6].max()], 1)])
        questions.append(dict(tenant=tenant, category=dump["category"], gold=set(dump["gold"]), x=x,
                              refs=[rows[u]["ref"] for u in candidates],
                              tokens=np.array([rows[u]["tokens"] for u in candidates])))
    return questions


FEATURES = ["keyword rr", "vector rr", "period rr", "cosine", "next turn's cosine", "previous turn's cosine",
            "session's top-3 cosine", "log tokens", "fused rr", "in keyword list", "in vector list",
            "cosine - best", "next - best", "previous - best", "session - best"]


def recall_at(order, gold, k):
    top = set(order[:k])
    return sum(g in top for g in gold) / len(gold)


def leave_one_conversation_out(questions, columns, model):
    tenants = sorted({q["tenant"] for q in questions})
    at = {k: [] for k in (1, 5, 10, 20)}
    adversarial, tokens = [], []
    for held in tenants:
        train = [q for q in questions if q["tenant"] != held]
        x = np.vstack([q["x"][:, columns] for q in train])
        y = np.concatenate([[float(r in q["gold"]) for r in q["refs"]] for q in train])
        mean, sd = x.mean(0), x.std(0) + 1e-9
        fitted = model().fit((x - mean) / sd, y)
        for q in (q for q in questions if q["tenant"] == held):
            order = np.argsort(-fitted.predict_proba((q["x"][:, columns] - mean) / sd)[:, 1], kind="stable")
            refs = [q["refs"][i] for i in order]
            tokens.append(q["tokens"][order[:10]].sum())
            if 1 <= q["category"] <= 4:
                for k in at:
                    at[k].append(recall_at(refs, q["gold"], k))
            elif q["category"] == 5:
                adversarial.append(recall_at(refs, q["gold"], 10))
    return [np.mean(at[k]) for k in (1, 5, 10, 20)] + [np.mean(adversarial), np.mean(tokens)]


def main():
    questions = load(*sys.argv[1:4])
    linear = lambda: LogisticRegression(max_iter=3000)
    trees = lambda: HistGradientBoostingClassifier(
        max_iter=200, learning_rate=0.05, max_leaf_nodes=15, early_stopping=False, random_state=0)
    every = list(range(len(FEATURES)))
    without_length = [c for c in every if c != 7]
    variants = [
        ("RRF as built (the fused rank alone)", [8], linear),
        ("the three lists' RRF terms", [0, 1, 2], linear),
        ("the lists' terms and the query's cosine", [0, 1, 2, 3], linear),
        ("the same and the neighbours' cosines", [0, 1, 2, 3, 4, 5], linear),
        ("RRF and the length", [8, 7], linear),
        ("every feature, linear", every, linear),
        ("every feature, gradient-boosted trees", every, trees),
        ("every feature but the length, linear", without_length, linear),
        ("every feature but the length, trees", without_length, trees),
    ]
    print("| ranker (leave one conversation out) | R@1 | R@5 | R@10 | R@20 | cat 5 R@10 | tokens in the top 10 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, columns, model in variants:
        r1, r5, r10, r20, adversarial, tokens = leave_one_conversation_out(questions, columns, model)
        print(f"| {name} | {r1:.3f} | {r5:.3f} | {r10:.3f} | {r20:.3f} | {adversarial:.3f} | {tokens:.0f} |")


if __name__ == "__main__":
    main()
