# A/B: the target (and the compact draft) on the kernels timed without `padded` (before) and with it (now), as
# `none`, `draft` and `head`: the bench's 21 prompts (3 Spec-Bench per category plus 3 code; evaluation only,
# never trained on), 48 new tokens, interleaved per prompt (the order flips every prompt and repeat), one process.
# Run from the repository: python docs/bench/padded-zen4/ab_padded.py REPEATS HEAD_DIR
import sys
from pathlib import Path
from draftwise import Engine
from draftwise.backends.kernels import DRAFT_KERNELS, EXACT_KERNELS, kernel_counts, on_timed_kernels
from draftwise.loading import load_models
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: the shared A/B loop
from interleaved_ab import report, run_interleaved

REPEATS, HEAD = int(sys.argv[1]), sys.argv[2]
target, tok, draft = load_models("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "auto", "cpu",
                                 progress=False)
without = lambda kernels: tuple(k for k in kernels if k != "padded")
fast = {"before": on_timed_kernels(target, without(EXACT_KERNELS)), "now": on_timed_kernels(target)}
ARMS = []
for when, model in fast.items():
    draft_kernels = without(DRAFT_KERNELS) if when == "before" else DRAFT_KERNELS
    print(when, "target kernels", kernel_counts(model), flush=True)
    ARMS += [(f"none:{when}", Engine.from_models(model, tok, None, method="none", loaded_model=target), "none"),
             (f"draft:{when}", Engine.from_models(model, tok, draft, method="draft", loaded_model=target,
                                                 draft_kernels=draft_kernels), "draft"),
             (f"head:{when}", Engine.from_models(model, tok, None, method="head", loaded_model=target, head=HEAD),
              "head")]
prompts, res = run_interleaved(ARMS, tok, REPEATS)
pairs = [(f"{m}:now", f"{m}:before") for m in ("none", "draft", "head")]
pairs += [(f"{m}:{w}", f"none:{w}") for w in fast for m in ("draft", "head")] + [(f"head:{w}", f"draft:{w}") for w in fast]
report(ARMS, prompts, res, pairs)
