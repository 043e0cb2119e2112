"""An interleaved A/B of speculation settings, on draftwise's public API only.

Every arm runs each prompt in turn, in one process, on the same loaded models; the order of the arms flips every
prompt and every repeat, so a slow spell of the machine (another process, a shared VM) falls on every arm alike.
It prints, per prompt, each arm's median tokens/s; per arm, what its drafts kept; and, against the first arm, the
geometric mean of the per-prompt ratios with a 95% bootstrap interval over prompts.

An arm is NAME=METHOD, optionally followed by generation options and a head folder:

    python docs/experiments/tools/interleaved_ab.py --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --dtype bfloat16 --per-category 3 --repeats 2 \
        none=none draft=draft k6=draft,num_draft_tokens=6 fixed=draft,adaptive=false

To compare two versions of the library, run this once per checkout with the same arguments: it cannot load two
versions into one process, and the runs are then only as comparable as the machine was steady between them.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from draftwise import Engine

ENGINE_OPTIONS = ("head", "batch_invariant")  # per-arm options that build an engine of their own; the rest go to generate()


def parse_arm(text: str) -> tuple[str, str, dict, dict]:
    """'k6=draft,num_draft_tokens=6' -> ('k6', 'draft', {'num_draft_tokens': 6}, {})."""
    name, _, spec = text.partition("=")
    method, *pairs = spec.split(",")
    if not name or not method:
        raise SystemExit(f"an arm is NAME=METHOD[,option=value...], got {text!r}")
    gen, eng = {}, {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        target = eng if key in ENGINE_OPTIONS else gen
        try:
            target[key] = json.loads(value)  # numbers, true/false
        except ValueError:
            target[key] = value  # a folder, a name
    return name, method, gen, eng


def model_folder(name: str) -> str:
    """A local folder as given, else the store's folder for a known name (`draftwise models path`, pulled if needed)."""
    if Path(name).is_dir():
        return name
    subprocess.run([sys.executable, "-m", "draftwise", "models", "pull", name], check=True, stdout=subprocess.DEVNULL)
    out = subprocess.run([sys.executable, "-m", "draftwise", "models", "path", name], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


def load(name: str | None, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name is None:
        return None, None
    folder = model_folder(name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def bench_prompts(args) -> list[tuple[str, str]]:
    """(category, text) pairs: a JSONL file of {"category", "text"}, or the bench's own set."""
    if args.prompts:
        rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        return [(r.get("category", "-"), r["text"]) for r in rows]
    from draftwise.bench.prompts import default_prompts, select_prompts  # the prompts `draftwise bench` runs

    return [(p.category, p.text) for p in select_prompts(default_prompts(), per_category=args.per_category)]


def interval(ratios: list[float], draws: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the geometric mean over prompts."""
    rng = random.Random(0)
    means = sorted(statistics.geometric_mean(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("arms", nargs="+", metavar="NAME=METHOD[,option=value...]")
    p.add_argument("--target", required=True)
    p.add_argument("--draft")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--prompts", help="JSONL of {category, text}; default: the bench's prompts")
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--pairs", default="", metavar="A/B,...", help="also print these arms' ratios, A against B")
    args = p.parse_args()

    arms = [parse_arm(a) for a in args.arms]
    target, tokenizer = load(args.target, args.dtype)
    draft, _ = load(args.draft, args.dtype)
    engines = {name: Engine.from_models(target, tokenizer, draft_model=draft, method=method, **eng)
               for name, method, _, eng in arms}
    prompts = bench_prompts(args)
    for name, _, gen, _ in arms:  # warm-up: kernels, caches, first timings
        engines[name].generate(prompts[0][1], chat=True, max_new_tokens=16, ignore_eos=True, **gen)

    runs: dict[tuple[str, int], list] = {}
    texts: dict[tuple[str, int], set] = {}
    start = time.time()
    for rep in range(args.repeats):
        for i, (_, text) in enumerate(prompts):
            for name, _, gen, _ in (arms if (rep + i) % 2 == 0 else arms[::-1]):
                result = engines[name].generate(text, chat=True, max_new_tokens=args.max_new_tokens,
                                                ignore_eos=True, **gen)
                runs.setdefault((name, i), []).append(result.stats)
                texts.setdefault((name, i), set()).add(tuple(result.token_ids))
        print(f"repeat {rep + 1} of {args.repeats} done at {time.time() - start:.0f} s", file=sys.stderr, flush=True)

    med = lambda name, i: statistics.median(s.tokens_per_s for s in runs[(name, i)])
    names = [a[0] for a in arms]
    print("| prompt | " + " | ".join(names) + " |\n| --- |" + " ---: |" * len(names))
    for i, (category, _) in enumerate(prompts):
        print(f"| {i} {category} | " + " | ".join(f"{med(n, i):.2f}" for n in names) + " |")
    for n in names:
        stats = [s for i in range(len(prompts)) for s in runs[(n, i)]]
        kept, offered = sum(s.accepted for s in stats), sum(s.proposed for s in stats)
        passes = sum(s.target_forwards for s in stats)
        same = sum(texts[(n, i)] == texts[(names[0], i)] for i in range(len(prompts)))
        print(f"{n}: kept {kept} of {offered} offered, {sum(s.new_tokens for s in stats) / max(1, passes):.2f} "
              f"tokens a target pass; same tokens as {names[0]} on {same} of {len(prompts)} prompts")
    pairs = [(n, names[0]) for n in names[1:]] + [tuple(pair.split("/")) for pair in args.pairs.split(",") if pair]
    for n, base in pairs:
        ratios = [med(n, i) / med(base, i) for i in range(len(prompts))]
        low, high = interval(ratios)
        print(f"{n} / {base}: geometric mean {statistics.geometric_mean(ratios):.3f} "
              f"(95% interval {low:.3f}-{high:.3f}), below 0.99 on {sum(r < 0.99 for r in ratios)} of {len(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
