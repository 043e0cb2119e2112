"""In one process, the target's passes on two builds of the kernel, alternating every round (the order flipped every
other round): 1 to 8 new tokens after a 200-token context, 2 a round, median over rounds. Runs in separate processes
drifted by more than the change, so the builds share one process, one model and one cache.

    DRAFTWISE_KERNEL_ISA=avx2 python docs/experiments/avx2-halves-zen5/passes_ab.py OLD.c NEW.c [ROUNDS]
"""
import statistics
import sys
import time
from pathlib import Path

from draftwise import Engine
from draftwise.backends import qgemm

sources, rounds = sys.argv[1:3], int(sys.argv[3]) if len(sys.argv) > 3 else 20
engine = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", method="none", backend="quant", progress=False)
slot = engine.target.open_slot()
slot.prefill([(i * 7919) % 20000 + 100 for i in range(200)])
widths = (1, 2, 3, 4, 6, 8)
times = {(s, w): [] for s in sources for w in widths}


def use(source: str) -> None:
    qgemm.SOURCE = Path(source)  # the library is built from (and cached by) its source's bytes
    qgemm.library.cache_clear()
    qgemm.library_for.cache_clear()
    qgemm.library()


for r in range(rounds + 1):  # the first round warms up
    for source in (sources if r % 2 else sources[::-1]):
        use(source)
        for w in widths:
            for _ in range(2):
                start = time.perf_counter()
                slot.forward([(i * 104729) % 20000 + 100 for i in range(w)])
                if r:
                    times[(source, w)].append(time.perf_counter() - start)
                slot.trim(200)
print("path", qgemm.kernel_isa())
for w in widths:
    old, new = (statistics.median(times[(s, w)]) * 1e3 for s in sources)
    print(f"{w} tokens: old {old:.2f} ms, new {new:.2f} ms, new/old {new / old:.3f}")
