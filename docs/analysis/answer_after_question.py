"""Where LoCoMo's missed evidence sits, and an offline try of one rule: a hit that asks a
question ("...?") brings the turn after it (the answer) in right behind it.

Input: a `mnemo-bench locomo --k 10,20 --dump dump.jsonl` file (each question's found ids, best
first, at most 20) and the LoCoMo JSON the benchmark read. Standard library only.

    python3 docs/analysis/answer_after_question.py dump.jsonl ../shared/bench/locomo/locomo-dev5.json
"""

import json
import sys
from collections import Counter

dump_path, data_path = sys.argv[1], sys.argv[2]
questions = [json.loads(line) for line in open(dump_path)]
text, speaker = {}, {}
for conversation in json.load(open(data_path)):
    tenant = conversation["sample_id"]
    for key, turns in conversation["conversation"].items():
        if key.startswith("session_") and isinstance(turns, list):
            for turn in turns:
                text[(tenant, turn["dia_id"])] = turn["text"]
                speaker[(tenant, turn["dia_id"])] = turn["speaker"]


def turn_after(dia_id):
    session, index = dia_id.split(":")
    return f"{session}:{int(index) + 1}"


def score(found_lists, k):
    """Mean recall@k of the gold turns over categories 1-4, and mean words in the top 10."""
    total = words = n = 0
    for q, found in zip(questions, found_lists):
        if q["category"] not in (1, 2, 3, 4):
            continue
        gold = set(q["gold"])
        total += len(gold & set(found[:k])) / len(gold)
        words += sum(len(text.get((q["tenant"], d), "").split()) for d in found[:10])
        n += 1
    return total / n, words / n


def answer_after_question(q, depth):
    """Each of the first `depth` hits ending with '?' brings the next turn right after it."""
    out = []
    for dia_id in q["found"]:
        if dia_id in out:
            continue
        out.append(dia_id)
        if len(out) > depth or not text.get((q["tenant"], dia_id), "").rstrip().endswith("?"):
            continue
        after = turn_after(dia_id)
        if (q["tenant"], after) in text and after not in out:
            out.append(after)
    return out


print("| rule | R@1 | R@5 | R@10 cat 1-4 | words in the top 10 |")
print("|---|---:|---:|---:|---:|")
lists = [q["found"] for q in questions]
print("| as built | " + " | ".join(f"{score(lists, k)[0]:.3f}" for k in (1, 5, 10)) + f" | {score(lists, 10)[1]:.1f} |")
for depth in (1, 2, 3, 5, 10):
    lists = [answer_after_question(q, depth) for q in questions]
    row = " | ".join(f"{score(lists, k)[0]:.3f}" for k in (1, 5, 10))
    print(f"| the answer after a question among the first {depth} | {row} | {score(lists, 10)[1]:.1f} |")

# Where the gold turns missed from the top 10 sit, relative to the top 10.
where, missed = Counter(), 0
for q in questions:
    if q["category"] not in (1, 2, 3, 4):
        continue
    top = q["found"][:10]
    for gold in q["gold"]:
        if gold in top:
            continue
        missed += 1
        session, index = gold.split(":")
        same_session = [abs(int(d.split(":")[1]) - int(index)) for d in top if d.split(":")[0] == session]
        if not same_session:
            where["in a session none of the top 10 is from"] += 1
        else:
            distance = min(same_session)
            where[f"{distance} turn(s) from a top-10 hit" if distance <= 3 else "in a top-10 hit's session, further"] += 1
        if gold in q["found"][10:20]:
            where["(of all these: ranked 11th to 20th)"] += 1
print(f"\ngold turns missed from the top 10 (categories 1-4): {missed}")
for place, count in sorted(where.items()):
    print(f"- {place}: {count}")
