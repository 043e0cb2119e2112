"""What the grammar costs per token: the target alone (`none`) on the structured prompts, each run under its schema,
then without it for exactly as many tokens (EOS ignored), interleaved, on the quant backend; and the mask alone
(Constraint.mask on one row and on a 5-token chain), timed at every position of the schema runs' texts.

Run from the repository root: .venv/bin/python docs/experiments/structured-zen4/mask_cost.py
"""
import json
import statistics
import time
from pathlib import Path

import torch

from draftwise import Engine
from draftwise.grammar import Grammar
from draftwise.types import Draft

PROMPTS = Path(__file__).with_name("prompts.jsonl")
REPEATS = 3


def main() -> None:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    engine = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", method="none", backend="quant", progress=False)
    engine.generate("warm up", max_new_tokens=8)
    per_token = {"schema": [], "free": []}
    masks = {1: [], 5: []}
    for row in rows:
        messages = [{"role": "user", "content": row["turns"][0]}]
        grammar = Grammar.json_schema(row["schema"])
        for _ in range(REPEATS):
            constrained = engine.generate(messages, chat=True, max_new_tokens=256, grammar=grammar)
            n = constrained.stats.new_tokens
            free = engine.generate(messages, chat=True, max_new_tokens=n, ignore_eos=True)
            per_token["schema"].append(constrained.stats.decode_s / n)
            per_token["free"].append(free.stats.decode_s / free.stats.new_tokens)
        constraint = engine.grammars.constraint(grammar)
        logits = torch.zeros(6, engine.grammars.vocab)
        tokens = constrained.token_ids[:-1]  # (the last is EOS)
        for i in range(len(tokens)):
            for width in masks:
                chain = Draft(tuple(tokens[i: i + width - 1]))  # the text's own next tokens as guesses: width rows
                started = time.perf_counter()
                constraint.mask(logits[: len(chain) + 1], chain)
                masks[width].append(time.perf_counter() - started)
            constraint.advance([tokens[i]])
    schema_ms = 1000 * statistics.median(per_token["schema"])
    free_ms = 1000 * statistics.median(per_token["free"])
    print(f"none, median ms per token over {len(rows)} prompts x {REPEATS}: under the schema {schema_ms:.2f}, "
          f"without {free_ms:.2f} (difference {schema_ms - free_ms:+.2f} ms, {schema_ms / free_ms - 1:+.1%})")
    for width, seconds in masks.items():
        print(f"Constraint.mask over {width} row(s): median {1e6 * statistics.median(seconds):.0f} us, "
              f"p90 {1e6 * sorted(seconds)[int(0.9 * len(seconds))]:.0f} us ({len(seconds)} positions)")


if __name__ == "__main__":
    main()
