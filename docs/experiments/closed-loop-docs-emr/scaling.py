"""Does a distilled draft's held-out agreement grow with the traffic it learns from, and how fast?

`draftwise distill`'s default recipe, run on the latest N of a proposal log's earlier requests for several N (nested:
each smaller set is the latest part of the larger), always judged on the same held-out latest requests (the
recipe's held-out share of the whole log). Prints and writes one JSON line per N: agreement and guesses kept in
rounds of 4 before and after, training seconds.

    .venv/bin/python docs/experiments/closed-loop-docs-emr/scaling.py LOG.db --sizes 61,123,246 --out scaling.jsonl

A record's script (it drives distill's trainer directly, to hold the held-out set fixed while the training set
varies), not part of the library.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from draftwise.loading import load_model
from draftwise.models import resolve
from draftwise.train.distill import Recipe, _order, _Trainer, agreement, run_key, with_adapter
from draftwise.train.served import Span, served_requests, time_split

DRAFT = "qwen2.5-coder-0.5b-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--sizes", default="61,123,246", help="requests trained on, comma-separated")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per size")
    args = parser.parse_args()
    recipe = Recipe()
    earlier, held_out = time_split(served_requests(args.logs), recipe.held_out)
    source = resolve(DRAFT, progress=False)
    base = load_model(str(source.path), source.gguf_file, "float32", "cpu", False)
    before = agreement(base, held_out, recipe.seq_len, True, "held-out, base")
    print(f"{len(earlier)} earlier requests, {len(held_out)} held out ({Span.of(held_out).tokens} tokens); base "
          f"agreement {before.share:.2%}, kept {before.kept_share:.2%}", flush=True)
    for size in [int(s) for s in args.sizes.split(",")]:
        train = earlier[-size:]
        model = with_adapter(load_model(str(source.path), source.gguf_file, "float32", "cpu", False), recipe)
        trainer = _Trainer(model, recipe, recipe.epochs * len(train), run_key(train, DRAFT, recipe))
        started = time.perf_counter()
        for step in tqdm(_order(len(train), recipe), desc=f"distill {size}", unit="request"):
            trainer.step(train[step])
        train_s = time.perf_counter() - started
        after = agreement(model, held_out, recipe.seq_len, True, "held-out, after")
        row = {"requests": len(train), "tokens": Span.of(train).tokens, "steps": trainer.total_steps,
               "train_s": round(train_s, 1), "held_out": len(held_out), "held_out_tokens": after.tokens,
               "agreement_before": before.share, "agreement_after": after.share,
               "kept_before": before.kept_share, "kept_after": after.kept_share, "recipe": asdict(recipe)}
        print(json.dumps(row), flush=True)
        with args.out.open("a") as out:
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
