"""Interleaved A/B of two checkouts of draftwise on the bench's prompts (see draftwise/bench/ab.py).

    python scripts/ab_checkouts.py --a /path/to/old-checkout --b . --methods none,draft,lookup,hybrid

Both arms load the same models in their own process; every (method, prompt) runs on each arm in turn.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftwise.bench.ab import Worker, format_rows, run_ab, summarize
from draftwise.bench.prompts import default_prompts, load_prompts, select_prompts
from draftwise.config import DEFAULT_DRAFT, DEFAULT_DRAFT_TOKENS, DEFAULT_TARGET


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, type=Path, help="the first checkout (the baseline)")
    p.add_argument("--b", required=True, type=Path, help="the second checkout")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--backend", default="hf", help="hf, quant, llamacpp or auto (Engine.from_pretrained's backend)")
    p.add_argument("--b-first", action="store_true",
                   help="load B's worker before A's: the arm loaded second has run slower whatever its code, so an "
                        "A/B of code is run in both load orders")
    p.add_argument("--methods", default="none,draft,lookup,hybrid")
    p.add_argument("--prompts", type=Path, help="a JSONL prompt file, as the bench's --prompts (default: the bench's "
                   "own set)")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("-k", type=int, default=DEFAULT_DRAFT_TOKENS)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args()

    pool = load_prompts(args.prompts) if args.prompts else default_prompts()
    prompts = [q.text for q in select_prompts(pool, per_category=args.per_category)]
    methods = args.methods.split(",")
    spec = {"target": args.target, "draft": args.draft, "method": "draft", "dtype": args.dtype,
            "backend": args.backend}
    names = ["A", "B"]
    print(f"A = {args.a.resolve()}\nB = {args.b.resolve()}\n{len(prompts)} prompts, methods {methods}, "
          f"{args.max_new_tokens} tokens, k {args.k}, {args.repeats} repeats", file=sys.stderr)
    order = [("B", args.b), ("A", args.a)] if args.b_first else [("A", args.a), ("B", args.b)]
    loaded = {name: Worker(path.resolve(), spec) for name, path in order}
    arms = {name: loaded[name] for name in names}
    for name, arm in arms.items():  # kernels are timed at load: a different choice explains a different speed
        print(f"{name} loaded: {json.dumps(arm.speed_paths)}", file=sys.stderr, flush=True)
    try:
        for arm in arms.values():  # a warm-up each, excluded
            arm.run(prompts[0], methods[0], 8, args.k)
        runs = run_ab(arms, prompts, methods, args.repeats, args.max_new_tokens, args.k,
                      log=lambda s: print(s, file=sys.stderr, flush=True))
    finally:
        for arm in arms.values():
            arm.close()
    rows = summarize(runs, names, methods, len(prompts))
    print(json.dumps(rows, indent=1) if args.json else format_rows(rows, names, len(prompts)))


if __name__ == "__main__":
    main()
