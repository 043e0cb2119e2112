"""In one process, the kernel's prefetch into the L1 or the L2, alternating every round (the order flipped every
other round): a target pass over 1, 4 and 8 new tokens after a 200-token context, 3 a round, median over rounds.

    python docs/experiments/prefetch-zen5/prefetch_ab.py [ROUNDS]      # DRAFTWISE_KERNEL_ISA=avx2 for that path
"""
import os
import statistics
import sys
import time

from draftwise import Engine
from draftwise.backends import qgemm
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
engine = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", method="none", backend="quant", progress=False)
slot = engine.target.open_slot()
slot.prefill([(i * 7919) % 20000 + 100 for i in range(200)])
levels, widths = ("l1", "l2"), (1, 4, 8)
times = {(l, w): [] for l in levels for w in widths}
def use(level):
    os.environ["DRAFTWISE_KERNEL_PREFETCH"] = level
    qgemm.library.cache_clear()
    qgemm.library_for.cache_clear()
    assert qgemm.kernel_prefetch() == level
for r in range(rounds + 1):
    for level in (levels if r % 2 else levels[::-1]):
        use(level)
        for w in widths:
            for _ in range(3):
                t = time.perf_counter(); slot.forward([(i * 104729) % 20000 + 100 for i in range(w)])
                if r: times[(level, w)].append(time.perf_counter() - t)
                slot.trim(200)
for w in widths:
    a, b = (statistics.median(times[(l, w)]) * 1e3 for l in levels)
    print(f"{w} tokens: l1 {a:.2f} ms, l2 {b:.2f} ms, l2/l1 {b / a:.3f}")
