# Usage: python online_k1.py default|exact (after long_requests.py)
import json, sys, time
from pathlib import Path
import draftwise.loading as loading
from draftwise.backends.kernels import EXACT_KERNELS
from draftwise import Engine
mode = sys.argv[1]
if mode == "exact":
    o = loading.on_timed_kernels
    loading.on_timed_kernels = lambda m, k=EXACT_KERNELS, w=(1,): o(m, EXACT_KERNELS if w == loading.HEAD_WIDTHS else k, w)
pieces = json.loads(Path("/tmp/longctx/pieces.json").read_text())
e = Engine.from_pretrained(target="qwen2.5-coder-1.5b-instruct", method="head")
print(mode, e.proposer.speed_paths)
acc = prop = 0; draft_s = verify_s = 0.0; fw = 0
for p in pieces[:8]:
    prompt = p["ids"][:p["answer_start"]]
    r = e.generate(prompt, max_new_tokens=len(p["ids"]) - p["answer_start"], num_draft_tokens=1, adaptive=False, ignore_eos=True)
    s = r.stats; acc += s.accepted; prop += s.proposed; draft_s += s.draft_s; verify_s += s.verify_s; fw += s.target_forwards
print(f"{mode}: k=1 acceptance {acc}/{prop} = {acc/prop:.3f}; c = {(draft_s/prop)/(verify_s/fw):.3f}")
