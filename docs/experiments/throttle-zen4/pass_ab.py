"""Issue 58: the target's plain pass for 6 rows opened as one method against 6 opened as another (k = 0 passes),
alternating, 40 each.

.venv/bin/python docs/experiments/throttle-zen4/pass_ab.py none,hybrid-tree"""
import os, statistics, sys, time

sys.path.insert(0, os.path.dirname(__file__))
from step_ab import alternating, opened_rows  # noqa: E402

engine, sets = opened_rows(sys.argv[1].split(","), max_new_tokens=96)


def one_pass(seqs):
    lengths = [len(s.context) for s in seqs]
    started = time.perf_counter()
    engine.target.forward_batch([(s.target, [s.context[-1]]) for s in seqs])
    seconds = time.perf_counter() - started
    for seq, n in zip(seqs, lengths):  # the pass wrote a position per row: the text only again
        seq.target.trim(n - 1)
    return seconds


times = {m: [] for m in sets}
for method, seqs in alternating(sets, 40):
    times[method].append(one_pass(seqs))
for method, seconds in times.items():
    print(method, "median %.1f ms" % (1000 * statistics.median(seconds[4:])), "min %.1f" % (1000 * min(seconds)))
