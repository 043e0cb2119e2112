"""Whether a cross-tokenizer guess should leave out its last target token (proposers/cross_vocab.CUT_LAST).

A guess cut after some draft tokens may stop inside a word the target spells as one token: leaving its last token
out wastes it where it was right, keeping it costs a row of the verification where it was wrong, and the guess
needs one draft forward fewer. Same process, one engine per draft, the variants interleaved prompt by prompt,
greedy, EOS ignored, draft length adaptive; tokens/s is the median of the repeats.

    .venv/bin/python docs/experiments/cross-tokenizer-zen4/cut_last.py --draft smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from draftwise import Engine
from draftwise.bench.prompts import default_prompts, select_prompts
from draftwise.proposers import cross_vocab

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="smollm2-135m-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    own = [json.loads(line)["turns"][0] for line in (HERE / "prompts.jsonl").read_text().splitlines()]
    texts = own + [p.text for p in select_prompts(default_prompts(), per_category=1)]
    engine = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", draft=args.draft, method="draft", progress=False)
    engine.generate(texts[0], chat=True, max_new_tokens=16)  # warm-up
    rows = {cut: {"speed": [], "kept": 0, "offered": 0, "forwards": 0, "tokens": 0} for cut in (True, False)}
    for text in texts:
        speeds = {cut: [] for cut in rows}
        for repeat in range(args.repeats):
            for cut in ((True, False) if repeat % 2 == 0 else (False, True)):
                cross_vocab.CUT_LAST = cut
                result = engine.generate(text, chat=True, max_new_tokens=args.max_new_tokens, ignore_eos=True)
                speeds[cut].append(result.stats.tokens_per_s)
                if repeat == 0:
                    row, stats = rows[cut], result.stats
                    row["kept"] += stats.accepted
                    row["offered"] += stats.proposed
                    row["forwards"] += stats.target_forwards
                    row["tokens"] += stats.new_tokens
        for cut in rows:
            rows[cut]["speed"].append(statistics.median(speeds[cut]))
    print(f"draft {args.draft}, {len(texts)} prompts, {args.max_new_tokens} tokens, torch threads "
          f"{torch.get_num_threads()}")
    print("| CUT_LAST | tokens/s (mean of prompt medians) | guesses kept | tokens per target pass |")
    print("| --- | --- | --- | --- |")
    for cut, row in rows.items():
        print(f"| {cut} | {statistics.mean(row['speed']):.2f} | {row['kept']}/{row['offered']} "
              f"({row['kept'] / max(row['offered'], 1):.2f}) | {row['tokens'] / row['forwards']:.2f} |")


if __name__ == "__main__":
    main()
