# Seconds per target pass by width: the timed plan without `padded` (before) against with it (now), interleaved,
# through the engine's backend on a 400-token cache, median of 15
import time, statistics, torch
from draftwise.loading import load_models
from draftwise.backends import kernels as K
from draftwise.backends.hf import HFBackend
target, tok, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
t0 = time.time(); plan = K.plan_kernels(target); print(f"plan {time.time()-t0:.1f} s", plan.choices)
for key, ms in plan.timings.items(): print(key, {k: [round(x, 2) for x in v] for k, v in ms.items()})
engines = {"before": K.on_timed_kernels(target, ("dense", "onednn", "split")), "now": K.with_kernels(target, plan)}
views = {}
for name, m in engines.items():
    print(name, K.kernel_counts(m))
    v = HFBackend(m).open_slot(); v.prefill(list(range(1000, 1400))); views[name] = (v, v.cache_len)
res = {}
widths = [1, 2, 3, 4, 5, 6, 8]
for rep in range(15):
    for name in (("before", "now") if rep % 2 == 0 else ("now", "before")):
        v, base = views[name]
        for n in widths:
            t = time.perf_counter(); v.forward(list(range(2000, 2000 + n))); res.setdefault((name, n), []).append(time.perf_counter() - t)
            v.trim(base)
for n in widths:
    a, p = statistics.median(res[("before", n)]), statistics.median(res[("now", n)])
    print(f"width {n}: before {1000*a:6.1f} ms  now {1000*p:6.1f} ms  ({p/a:.2f}x)", flush=True)
