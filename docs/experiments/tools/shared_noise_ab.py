"""Sampled speculation three ways, in one process on the same engine, interleaved prompt by prompt:

- `fixed-k rejection`: what a seeded request ran before shared noise, rejection sampling at a fixed k (a seeded
  request's draws followed its round shapes, so its k could not follow the timings);
- `shared noise`: a seeded request now (shared_noise.py), its k chosen from the measured costs;
- `adaptive rejection`: an unseeded request (rejection sampling, adaptive k), each run's generator seeded here.

    .venv/bin/python docs/experiments/tools/shared_noise_ab.py [--methods none,draft,hybrid,hybrid-tree]
        [--temperature 0.7] [--tokens 96] [--repeats 1]

Prints each method and arm's decode ms a token (the sum of decode seconds over the sum of tokens), draft tokens kept
over offered, and whether every seeded text equals `none`'s. The prompts are ordinary chat written for this
record (none from a benchmark set)."""
from __future__ import annotations

import argparse
from collections import defaultdict
from unittest import mock

from draftwise import Engine
from draftwise.sampling import make_generator

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Give me five tips for keeping a small vegetable garden healthy through a dry summer.",
    "Draft a polite email to a landlord asking to fix a leaking kitchen tap.",
    "Explain to a ten-year-old why the sky looks blue during the day and red at sunset.",
    "What should someone consider before adopting a dog for the first time?",
    "Describe the plot of a mystery novel set on a night train through the Alps.",
    "Compare living in a big city with living in a small town, with pros and cons of each.",
    "Write a cover letter for a junior data analyst position at a logistics company.",
    "How do vaccines train the immune system? Keep it simple.",
    "Plan a three-day itinerary for a first visit to Lisbon.",
    "Explain the rules of chess castling and when it is not allowed.",
    "Write a persuasive paragraph on why cities should build more bicycle lanes.",
]
ARMS = ("fixed-k rejection", "shared noise", "adaptive rejection")


def run(eng: Engine, prompt: str, method: str, arm: str, seed: int, args) -> object:
    options = dict(chat=True, max_new_tokens=args.tokens, temperature=args.temperature, ignore_eos=True, method=method,
                   num_draft_tokens=args.k)
    if arm == "shared noise":
        return eng.generate([{"role": "user", "content": prompt}], seed=seed, **options)
    with mock.patch("draftwise.lifecycle.make_generator", lambda _: make_generator(seed)):
        return eng.generate([{"role": "user", "content": prompt}], adaptive=arm != "fixed-k rejection", **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--backend", default="quant")
    parser.add_argument("--methods", default="none,draft,hybrid,hybrid-tree")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=4, help="the most a round drafts (the fixed arm's every round)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    eng = Engine.from_pretrained(args.target, draft=args.draft, method="draft", backend=args.backend, progress=False)
    eng.generate("def f(x):", max_new_tokens=8)  # (warm: the first pass is timed apart)
    methods = args.methods.split(",")
    totals = defaultdict(lambda: [0.0, 0, 0, 0])  # (method, arm): decode s, tokens, kept, offered
    seeded_texts, same = {}, True
    for repeat in range(args.repeats):
        for i, prompt in enumerate(PROMPTS):
            for method in methods:
                for arm in ARMS if method != "none" else ARMS[:2]:
                    result = run(eng, prompt, method, arm, seed=i, args=args)
                    total = totals[method, arm]
                    total[0] += result.stats.decode_s
                    total[1] += len(result.token_ids)
                    total[2] += result.stats.accepted
                    total[3] += result.stats.proposed
                    if arm == "shared noise":
                        seeded_texts.setdefault(i, result.token_ids)
                        same &= result.token_ids == seeded_texts[i]
            print(f"prompt {i + 1}/{len(PROMPTS)}", flush=True)
    print(f"temperature {args.temperature}, {args.tokens} tokens, k up to {args.k}, {len(PROMPTS)} prompts x "
          f"{args.repeats}")
    print("| method | arm | decode ms a token | kept / offered |")
    print("| --- | --- | ---: | ---: |")
    for (method, arm), (seconds, tokens, kept, offered) in totals.items():
        rate = f"{kept}/{offered} = {kept / offered:.2f}" if offered else "-"
        print(f"| {method} | {arm} | {seconds / tokens * 1e3:.1f} | {rate} |")
    print("every seeded text equal to none's:", same)


if __name__ == "__main__":
    main()
