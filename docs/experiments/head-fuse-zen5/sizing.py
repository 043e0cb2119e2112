# Usage: python sizing.py (after long_requests.py): the default head with its fuse on int8-dynamic and on the
# model's own values, adaptive (k up to 4), 64 new tokens over long held-back requests 9 to 14; the tree sizing's
# state after each engine's six requests.
import json
from pathlib import Path
import draftwise.loading as loading
from draftwise import Engine
from draftwise.backends.kernels import on_timed_kernels
from draftwise.loading import load_models
pieces = json.loads(Path("/tmp/longctx/pieces.json").read_text())
H = "/root/.cache/draftwise/heads/qwen2.5-coder-1.5b-instruct"
target, tok, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
fast = on_timed_kernels(target)
fixed = loading.EXACT_INPUT_LAYERS
loading.EXACT_INPUT_LAYERS = ()
engines = {"int8fuse": Engine.from_models(fast, tok, None, method="head", loaded_model=target, head=H)}
loading.EXACT_INPUT_LAYERS = fixed
engines["fixed"] = Engine.from_models(fast, tok, None, method="head", loaded_model=target, head=H)
for name, e in engines.items():
    tot = {"prop": 0, "acc": 0, "nodes": 0, "rounds": 0, "fw": 0, "new": 0}
    for p in pieces[8:14]:
        prompt = p["ids"][:p["answer_start"]]
        s = e.generate(prompt, max_new_tokens=64, ignore_eos=True).stats
        for k, v in (("prop", s.proposed), ("acc", s.accepted), ("nodes", s.nodes), ("rounds", s.rounds), ("fw", s.target_forwards), ("new", s.new_tokens)):
            tot[k] += v
    sz = e.proposer.sizing
    trust = {d: round(sz.trust(d), 3) for d in range(1, 5)}
    claimed = {d: round(sz._claimed_at[d], 2) for d in sorted(sz._claimed_at)}
    kept = {d: round(sz._kept_at[d], 2) for d in sorted(sz._kept_at)}
    print(name, tot, "kept/offered %.3f" % (tot["acc"] / max(1, tot["prop"])), "nodes/round %.2f" % (tot["nodes"] / max(1, tot["rounds"])),
          "tokens/pass %.2f" % (tot["new"] / max(1, tot["fw"])), "forward_s", sz.forward_s, "trust", trust, "claimed", claimed, "kept", kept, flush=True)
