"""A one-token forward of target and draft at several contexts: what attention over the float32 cache costs."""
import time, statistics
from draftwise import Engine
from draftwise.backends.hf import HFBackend
eng = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", method="draft",
                             backend="auto", progress=False)
for label, model, n in (("draft", eng.proposer.backend.model, 40), ("target", eng.target.model, 15)):
    for ctx in (200, 800, 1500, 3000):
        b = HFBackend(model)
        prompt = [(7 * i + 3) % 1000 for i in range(ctx)]
        b.prefill(prompt)
        for _ in range(3):
            b.forward(prompt[:1]); b.trim(ctx)
        ts = []
        for _ in range(n):
            t = time.perf_counter(); b.forward(prompt[:1]); ts.append(time.perf_counter() - t); b.trim(ctx)
        print(f"{label} ctx {ctx}: {statistics.median(ts)*1000:.2f} ms", flush=True)
