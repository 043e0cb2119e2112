"""Issue 83, item 4, served: `draftwise serve --method hybrid` against llama-server (the same two GGUF files, 4 slots,
with the draft loaded, and plain), sampled at temperature 0.7, at 1 and 4 requests in flight; aggregate tok/s.

    python docs/experiments/sampled-served-spr/compare.py --out /tmp/sampled-served

Each server is started on 127.0.0.1 in turn and stopped after its run; see README.md beside this file.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftwise.bench.llamacpp_server import find_gguf
from draftwise.bench.load_plan import LoadPlan
from draftwise.bench.prompts import default_prompts, select_prompts
from draftwise.bench.served_compare import comparison_table, draftwise_arm, llama_arms, run_arms

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=TARGET, help="the target, by name (its GGUF from the model store)")
    p.add_argument("--draft", default=DRAFT, help="the draft, likewise")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--requests", type=int, default=8, help="counted requests per level (after the warm-up)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-category", type=int, default=1, help="prompts of each bench category")
    p.add_argument("--arms", default="llama-draft,llama-plain,draftwise",
                   help="which servers, in this order, comma-separated")
    p.add_argument("--out", default="sampled-served-results")
    a = p.parse_args()

    target_gguf, draft_gguf = find_gguf(a.target), find_gguf(a.draft, option="--draft")
    llama_draft, llama_plain = llama_arms(target_gguf, draft_gguf)
    ours = draftwise_arm(a.target, a.draft)
    chosen = {"llama-draft": llama_draft, "llama-plain": llama_plain, "draftwise": ours}
    arms = [chosen[name] for name in a.arms.split(",")]
    prompts = tuple(select_prompts(default_prompts(), "all", a.per_category))
    plan = LoadPlan(url="http://127.0.0.1:1", levels=tuple(int(c) for c in a.concurrency.split(",")),
                    modes=("on",), prompts=prompts, requests=a.requests, max_tokens=a.max_tokens,
                    temperature=a.temperature, seed=a.seed, timeout=600.0)
    print(f"target {target_gguf}\ndraft {draft_gguf}", file=sys.stderr)
    rows = run_arms(arms, plan, Path(a.out), log=lambda line: print(line, file=sys.stderr, flush=True))
    table = comparison_table(rows, ours.name)
    Path(a.out, "comparison.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
