# A/B: heads given as NAME=DIR, each as `head` and `hybrid-head`, beside `none` and `draft`: the bench's 21 prompts
# (3 Spec-Bench per category plus 3 code; evaluation only, never trained on), 48 new tokens, interleaved per prompt
# (the order flips every prompt and repeat), one process, one copy of the target on its timed kernels for every engine.
# Run from the repository: python docs/bench/head-data-zen5/ab_heads.py REPEATS NAME=DIR NAME=DIR ...
# (the first head is the one the others are compared with)
import sys
from pathlib import Path
from draftwise import Engine
from draftwise.backends.kernels import on_timed_kernels
from draftwise.loading import load_models
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: the shared A/B loop
from interleaved_ab import report, run_interleaved

REPEATS = int(sys.argv[1])
HEADS = dict(arg.split("=", 1) for arg in sys.argv[2:])
target, tok, draft = load_models("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "auto", "cpu",
                                 progress=False)
fast = on_timed_kernels(target)
engines = {name: Engine.from_models(fast, tok, None, method="head", loaded_model=target, head=d) for name, d in HEADS.items()}
engines["draft"] = Engine.from_models(fast, tok, draft, method="draft", loaded_model=target)
first = next(iter(HEADS))
ARMS = [("none", engines[first], "none"), ("draft", engines["draft"], "draft")]
ARMS += [(f"{m}:{h}", engines[h], m) for m in ("head", "hybrid-head") for h in HEADS]
prompts, res = run_interleaved(ARMS, tok, REPEATS)
pairs = [(f"{m}:{h}", f"{m}:{first}") for m in ("head", "hybrid-head") for h in HEADS if h != first]
pairs += [(a, "none") for a, _, _ in ARMS[1:]] + [(a, "draft") for a, _, _ in ARMS[2:]]
report(ARMS, prompts, res, pairs)
