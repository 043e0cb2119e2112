"""Prefill seconds of the quant backend at n random tokens (median of repeats), one model a process.

    python docs/experiments/prefill-attention-zen5/prefill.py qwen2.5-coder-1.5b-instruct 512,1450 3
"""
import sys, time, statistics, random
from draftwise import Engine
name, sizes, reps = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3]) if len(sys.argv) > 3 else 3
eng = Engine.from_pretrained(name, method="none", backend="quant")
be = eng.target
rng = random.Random(0)
for n in sizes:
    ids = [rng.randrange(100, 30000) for _ in range(n)]
    ts = []
    for r in range(reps):
        view = be.open_slot()
        t = time.perf_counter(); view.prefill(ids); ts.append(time.perf_counter() - t)
        view.close()
    m = statistics.median(ts)
    print(f"{name} prefill {n}: {m:.2f} s, {n / m:.1f} tok/s ({', '.join(f'{x:.2f}' for x in ts)})", flush=True)
