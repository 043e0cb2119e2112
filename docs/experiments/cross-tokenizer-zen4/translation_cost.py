"""What drafting through text costs beside the draft's forwards: the seconds a round spends in the translation
(token_text.py's encoding and bytes, cross_vocab.py's reading of the text and spelling of the guess), against the
draft forwards' and the target passes' seconds. One generation under cProfile (whose overhead inflates the Python
side, so the translation's share is an upper bound).

    .venv/bin/python docs/experiments/cross-tokenizer-zen4/translation_cost.py --draft smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
import cProfile
import pstats

from draftwise import Engine

PROMPT = "Write a Python function that merges two sorted lists into one sorted list, with a docstring."
TEXT_WORK = ("_catch_up", "_sync", "_align", "_translate", "_on_text", "observe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="smollm2-135m-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    engine = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", draft=args.draft, method="draft", progress=False)
    engine.generate(PROMPT, chat=True, max_new_tokens=16)  # warm-up
    profile = cProfile.Profile()
    profile.enable()
    result = engine.generate(PROMPT, chat=True, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    profile.disable()
    stats = pstats.Stats(profile).stats
    # the cumulative seconds of the proposer's text work: none of these runs a forward, none calls another of them
    translation = sum(row[3] for (path, _, name), row in stats.items()
                      if path.endswith("cross_vocab.py") and name in TEXT_WORK)
    rounds = result.stats.target_forwards
    print(f"draft {args.draft}: {result.stats.new_tokens} tokens in {rounds} target passes, "
          f"{result.stats.decode_s:.2f} s decoding")
    print(f"translation {1000 * translation:.1f} ms in all, {1000 * translation / rounds:.3f} ms a round "
          f"({100 * translation / result.stats.decode_s:.2f}% of decoding); draft forwards "
          f"{result.stats.draft_s:.2f} s, target passes {result.stats.verify_s:.2f} s")


if __name__ == "__main__":
    main()
