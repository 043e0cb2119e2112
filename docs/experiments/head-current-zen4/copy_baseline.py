# Measurement only (evaluation data, never trained on): how often copying from earlier text would guess the target's
# next token, over the target's greedy answers to 56 bench prompts (8 a category, up to 96 tokens; the answers
# head-everyday-zen5/bench_top1.py keeps in /tmp/diag). At each answer position, given the text up to x_{t+1}, the
# guess for the target's next token is the token that followed the most recent earlier x_{t+1} (1 token matched), or
# the most recent earlier (x_t, x_{t+1}) (2 matched), and 1 matched within the last WINDOW positions only (how far the
# head attends: its training's window). "guess": a match was found; "right": the share of all positions where the
# guess is the target's token. The heads' own top-1 on the same positions is in bench_top1.txt.
# Run from the repository: python docs/bench/head-current-zen4/copy_baseline.py [/tmp/diag/bench_answers_8_96.pt]
import collections
import sys
import torch

WINDOW = 512

answers = torch.load(sys.argv[1] if len(sys.argv) > 1 else "/tmp/diag/bench_answers_8_96.pt")
# positions, 1 matched: guessed, right; 2 matched: guessed, right; 1 matched in the window: right
stats = collections.defaultdict(lambda: [0] * 6)
for answer in answers:
    ids, wanted, start = answer["ids"].tolist(), answer["next"].tolist(), answer["answer_start"]
    row = stats[answer["category"]]
    for u in range(max(start, 1), len(ids)):  # u = t + 1, the last token given; the target's next token: wanted[u]
        row[0] += 1
        one = next((j for j in range(u - 1, -1, -1) if ids[j] == ids[u]), None)
        if one is not None:
            row[1] += 1
            row[2] += ids[one + 1] == wanted[u]
        two = next((j for j in range(u - 1, 0, -1) if ids[j] == ids[u] and ids[j - 1] == ids[u - 1]), None)
        if two is not None:
            row[3] += 1
            row[4] += ids[two + 1] == wanted[u]
        near = next((j for j in range(u - 1, max(-1, u - WINDOW - 1), -1) if ids[j] == ids[u]), None)
        row[5] += near is not None and ids[near + 1] == wanted[u]
total = [sum(row[i] for row in stats.values()) for i in range(6)]
for category, row in [*stats.items(), ("all", total)]:
    n = row[0]
    print(f"{category:14s} positions {n:4d}  1 matched: guess {row[1] / n:4.0%} right {row[2] / n:5.1%}  "
          f"2 matched: guess {row[3] / n:4.0%} right {row[4] / n:5.1%}  1 matched within {WINDOW}: right {row[5] / n:5.1%}")
