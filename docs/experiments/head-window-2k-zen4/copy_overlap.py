# Measurement only (evaluation data, never trained on): does the head copy where copying would be right? Over the
# target's answers to the bench prompts (head-everyday-zen5/bench_top1.py's cache), each scored position is put in one
# of two sets: "copy right", where the token that followed the most recent earlier copy of the last token, within the
# head's attention window, is the target's next token; and "other". The head's top-1 (as the engine runs it, as in
# head/as_run.py) is reported on each. A head that learnt to copy scores near 100% on the first set.
# Run from the repository: python docs/bench/head-window-2k-zen4/copy_overlap.py HEAD_DIR ... (answers cache optional
# as ANSWERS=path)
import collections
import os
import sys

import torch

from draftwise.head.as_run import first_guesses
from draftwise.loading import head_proposer, load_models

answers = torch.load(os.environ.get("ANSWERS", "/tmp/diag/bench_answers_8_96.pt"))
target, _, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)


def copy_guess(ids: list[int], last: int, window: int) -> int | None:
    """The token after the most recent earlier copy of ids[last] within window positions, or None."""
    for j in range(last - 1, max(-1, last - window - 1), -1):
        if ids[j] == ids[last]:
            return ids[j + 1]
    return None


for folder in sys.argv[1:]:
    proposer = head_proposer(target, os.path.expanduser(folder))
    window = proposer.window or 10**9
    # category -> [copy-right positions, head right there, other positions, head right there]
    stats = collections.defaultdict(lambda: [0, 0, 0, 0])
    for answer in answers:
        ids, wanted = answer["ids"].tolist(), answer["next"].tolist()
        for last, guess in first_guesses(proposer, answer):
            hit = bool(guess) and guess[0] == wanted[last]
            copy_right = copy_guess(ids, last, window) == wanted[last]
            for category in (answer["category"], "all"):
                row = stats[category]
                row[0 if copy_right else 2] += 1
                row[1 if copy_right else 3] += hit
    print(f"{folder} (window {window})")
    for category, (n_copy, h_copy, n_other, h_other) in stats.items():
        print(f"  {category:14} copy right at {n_copy:4} of {n_copy + n_other:4}: head right there "
              f"{100 * h_copy / max(1, n_copy):5.1f}% | elsewhere {100 * h_other / max(1, n_other):5.1f}%", flush=True)
