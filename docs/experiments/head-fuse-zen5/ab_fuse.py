# A/B: the default head with its fuse layer on int8-dynamic (as before 14163fa) against the same head with the fuse on
# the model's own values (14163fa), and a head trained 10 epochs on the same data, as `head` and `hybrid-head`, beside
# `none` and `draft`: the bench's 21 prompts (3 Spec-Bench per category plus 3 code; evaluation only, never trained
# on), 48 new tokens, interleaved per prompt (the order flips every prompt), one process, one copy of the target on
# its timed kernels shared by every engine.
# Run from the repository: python docs/bench/head-fuse-zen5/ab_fuse.py HEAD_DIR [HEAD10_DIR or -] [repeats]
import sys
from pathlib import Path
import draftwise.loading as loading
from draftwise import Engine
from draftwise.backends.kernels import on_timed_kernels
from draftwise.loading import load_models
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: the shared A/B loop
from interleaved_ab import report, run_interleaved

HEAD = sys.argv[1]
HEAD10 = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
REPEATS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
target, tok, draft = load_models("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "auto", "cpu",
                                 progress=False)
fast = on_timed_kernels(target)
fixed = loading.EXACT_INPUT_LAYERS
loading.EXACT_INPUT_LAYERS = ()  # the fuse on whatever kernel is timed fastest, as before 14163fa
engines = {"int8fuse": Engine.from_models(fast, tok, None, method="head", loaded_model=target, head=HEAD)}
loading.EXACT_INPUT_LAYERS = fixed
engines["fixed"] = Engine.from_models(fast, tok, None, method="head", loaded_model=target, head=HEAD)
if HEAD10:
    engines["e10"] = Engine.from_models(fast, tok, None, method="head", loaded_model=target, head=HEAD10)
engines["draft"] = Engine.from_models(fast, tok, draft, method="draft", loaded_model=target)
for name, e in engines.items():
    print(name, e.speed_paths.get("head", {}).get("kernels") or e.speed_paths.get("draft_kernels"))
ARMS = [("none", engines["fixed"], "none"), ("draft", engines["draft"], "draft")]
ARMS += [(f"{m}:{h}", engines[h], m) for m in ("head", "hybrid-head") for h in engines if h != "draft"]
prompts, res = run_interleaved(ARMS, tok, REPEATS)
pairs = [("head:fixed", "head:int8fuse"), ("hybrid-head:fixed", "hybrid-head:int8fuse")]
if HEAD10:
    pairs += [("head:e10", "head:fixed"), ("hybrid-head:e10", "hybrid-head:fixed")]
pairs += [(a, "none") for a, _, _ in ARMS[1:]] + [(a, "draft") for a, _, _ in ARMS[2:]]
report(ARMS, prompts, res, pairs)
