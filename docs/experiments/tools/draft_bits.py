"""A/B of a draft's block width on the quant route: the 0.5B draft on 4-bit blocks (the default) against its decoder
layers re-quantized to 2 bits (gguf_model.load_gguf_model(draft_bits=2)), beside the same 1.5B target.

    .venv/bin/python docs/experiments/tools/draft_bits.py [--methods draft,hybrid] [--tokens 96] [--repeats 2]

Both engines load once; each prompt runs every method on each width in turn (interleaved), greedy, EOS ignored; the
median decode tok/s and the acceptance over all runs are printed per method and width, and whether every text was
the same. The prompts are written here, none from a benchmark set."""
from __future__ import annotations

import argparse
import statistics

from draftwise import Engine
from draftwise.backends.gguf_model import load_gguf_model
from draftwise.loading import QUANT_ASSEMBLY
from draftwise.models import resolve

PROMPTS = [
    "Write a Python class for an LRU cache with get and put methods, and explain its complexity.",
    "Describe how a compiler's register allocator decides which variables live in registers.",
    "Rewrite this function to use a generator instead of building a list:\ndef evens(n):\n    out = []\n"
    "    for i in range(n):\n        if i % 2 == 0:\n            out.append(i)\n    return out",
    "Give three tips for writing clear commit messages, with an example of each.",
    "Explain the CAP theorem to a backend developer in plain words.",
    "Write a bash script that finds the ten largest files under a directory and prints their sizes.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--methods", default="draft,hybrid")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    methods = args.methods.split(",")
    plain = Engine.from_pretrained(args.target, method="none", backend="quant", progress=False)
    target, tokenizer = plain.target.model, plain.tokenizer
    draft_file = resolve(args.draft, progress=False).published_gguf(args.draft, "the quant backend")
    engines = {bits: Engine.from_models(target, tokenizer, method=methods[0], **QUANT_ASSEMBLY,
                                        draft_model=load_gguf_model(draft_file, progress=False, draft=True,
                                                                    draft_bits=bits))
               for bits in (4, 2)}
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in PROMPTS]
    for eng in engines.values():
        eng.generate(texts[0], max_new_tokens=16, ignore_eos=True)  # warm-up
    runs, same = {(m, b): [] for m in methods for b in engines}, True
    for _ in range(args.repeats):
        for text in texts:
            want = plain.generate(text, max_new_tokens=args.tokens, ignore_eos=True).token_ids
            for method in methods:
                for bits, eng in engines.items():
                    out = eng.generate(text, max_new_tokens=args.tokens, ignore_eos=True, method=method)
                    runs[(method, bits)].append((args.tokens / out.stats.decode_s, out.stats.accepted,
                                                 out.stats.proposed))
                    same &= out.token_ids == want
    for (method, bits), rows in runs.items():
        proposed = sum(r[2] for r in rows)
        print(f"{method:8s} {bits}-bit draft: median {statistics.median(r[0] for r in rows):.1f} tok/s, "
              f"acceptance {sum(r[1] for r in rows) / max(1, proposed):.3f} of {proposed} proposed")
    print("every text none's:", same)


if __name__ == "__main__":
    main()
