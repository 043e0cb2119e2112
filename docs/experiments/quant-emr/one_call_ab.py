"""A target pass over 1, 2, 4 and 8 new tokens on the quant backend, a decoder layer in one C call against its parts
called one by one from Python (the same bits), interleaved round by round in one process; medians of 15 rounds.

    .venv/bin/python docs/experiments/quant-emr/one_call_ab.py [MODEL]
"""
import time, statistics, sys
import torch
from draftwise import Engine
from draftwise.backends import quant_layers as ql
name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b-instruct"
eng = Engine.from_pretrained(name, method="none", backend="quant", progress=False)
slot = eng.target.open_slot()
slot.prefill([(i * 7919) % 20000 + 100 for i in range(200)])
orig = ql._OneCall.struct
modes = {"parts": lambda self, layer: None, "one-call": orig}
W = (1, 2, 4, 8)
times = {(m, w): [] for m in modes for w in W}
for r in range(16):
    for m, f in modes.items():
        ql._OneCall.struct = f
        for w in W:
            t = time.perf_counter(); slot.forward([(r * 104729 + j) % 20000 + 100 for j in range(w)]); dt = time.perf_counter() - t
            slot.trim(200)
            if r: times[(m, w)].append(dt)
for m in modes:
    print(m, " ".join(f"{w}:{statistics.median(times[(m, w)])*1e3:.1f}ms" for w in W))
