# Measurement: how the head's top-1 grows with its training data, and where the 0.5B draft model stands on the same
# text. Heads are trained from scratch with the default recipe (TrainConfig(): 5 epochs, read-current, readout from
# the subset's own frequent tokens) on seeded fractions of the mix-rc run's training sequences (the same answers and
# corpus pieces, features reused; the held-back files stay held back), then scored two ways with training's own
# validation (_Trainer.evaluate: depth-1 top-1, float32 weights under bf16 autocast): on the held-back split, and on
# the target's greedy answers to 56 Spec-Bench prompts (evaluation only, never trained on; bench_top1.py's cache).
# The mix-rc head itself (all of the training sequences, trained by `draftwise train-head`) is scored the same way.
# The draft model's top-1 on those answers is its greedy next token against the target's, at the same positions.
# Run from the repository: python docs/bench/head-scaling-zen4/data_scaling.py MIX_RC_DIR BENCH_CACHE FRACTION ...
import collections
import json
import random
import sys
import time
from pathlib import Path

import torch

from draftwise.head.corpus import Piece, training_sequences
from draftwise.head.features import collect, load_shards
from draftwise.head.model import FeatureHead, HeadConfig, load_head, readout_ids, readout_layer
from draftwise.head.train import TrainConfig, _held_back, _Trainer, frequent_tokens
from draftwise.loading import load_models


def load_run(mix: Path):
    """(target, tokenizer, the run's TrainConfig, its record, training sequences, held-back sequences)."""
    target, tokenizer, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
    record = json.loads((mix / "training.json").read_text())
    cfg = TrainConfig(**{**record["config"], "feature_layers": tuple(record["config"]["feature_layers"])})
    # The run's sequences in its own order (answers, everyday answers, corpus pieces), so the shards line up.
    pieces = [Piece(**p) for name in ("answers.json", "everyday.json")
              for p in json.loads((mix / name).read_text())["pieces"]]
    pieces += training_sequences(tokenizer, cfg.seq_len, cfg.max_tokens)
    data = load_shards(collect(target, [p.ids for p in pieces], mix / "features", progress=False))  # all there
    assert len(data) == len(pieces) == record["sequences"], (len(data), len(pieces), record["sequences"])
    for sequence, piece in zip(data, pieces):
        sequence["answer_start"] = piece.answer_start
    train = [s for s, p in zip(data, pieces) if not _held_back(p.source)]
    val = [s for s, p in zip(data, pieces) if _held_back(p.source)]
    return target, tokenizer, cfg, record, train, val


def scores(trainer: _Trainer, bench: list[dict], val: list[dict], prepare=lambda sequence: None) -> str:
    """Held-back and bench-answer top-1 by category; prepare(sequence) runs before each sequence is scored."""
    hits, counted = collections.Counter(), collections.Counter()
    for group, sequences in (("held", val), ("bench", bench)):
        for sequence in sequences:
            prepare(sequence)
            accuracy = trainer.evaluate([sequence])
            for key in ((group,) if group == "held" else (sequence["category"], "all")):
                hits[key] += accuracy.top1 * accuracy.tokens
                counted[key] += accuracy.tokens
    return (f"held back {100 * hits['held'] / counted['held']:.1f}%; bench answers "
            + ", ".join(f"{c} {100 * hits[c] / counted[c]:.1f}%" for c in sorted(counted) if c != "held"))


def new_trainer(target, tokenizer, cfg: TrainConfig, subset: list[dict], total_steps: int, widen=lambda head: None):
    """A fresh head (widen(head) may change it before its optimizer is made) and its trainer."""
    torch.manual_seed(cfg.seed)
    ids = readout_ids(target.get_output_embeddings().weight.shape[0], cfg.readout, tokenizer.all_special_ids,
                      frequent_tokens(subset))
    head = FeatureHead(HeadConfig.for_target(target.config, len(ids), cfg.intermediate_size, "",
                                             cfg.feature_layers, cfg.reads_current))
    widen(head)
    return trainer_for(target, head, ids, cfg, total_steps)


def trainer_for(target, head: FeatureHead, ids: torch.Tensor, cfg: TrainConfig, total_steps: int) -> _Trainer:
    """head's trainer, reading out ids through the target's own output layer."""
    return _Trainer(head, readout_layer(target, ids).float(), target.get_input_embeddings(), ids,
                    target.get_output_embeddings().weight.shape[0], cfg, total_steps=total_steps)


def train_epochs(trainer: _Trainer, cfg: TrainConfig, subset: list[dict], prepare=lambda sequence: None) -> None:
    order = random.Random(cfg.seed)
    for _ in range(cfg.epochs):
        shuffled = subset[:]
        order.shuffle(shuffled)
        for sequence in shuffled:
            prepare(sequence)
            trainer.step(sequence)


def draft_top1(bench: list[dict]) -> str:
    draft = load_models("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "auto", "cpu",
                        progress=False)[2]
    hits, counted = collections.Counter(), collections.Counter()
    with torch.inference_mode():
        for answer in bench:
            guesses = draft(input_ids=answer["ids"][None], use_cache=False).logits[0].argmax(-1)  # [L]
            # Position q's guess is the token after q; scored where that token is the answer's, as the heads are.
            scored = torch.arange(len(guesses)) + 1 >= answer["answer_start"]
            right = ((guesses == answer["next"]) & scored)[1:]
            for category in (answer["category"], "all"):
                hits[category] += int(right.sum())
                counted[category] += int(scored[1:].sum())
    return ", ".join(f"{c} {100 * hits[c] / counted[c]:.1f}%" for c in sorted(counted))


def main(mix: Path, bench_cache: Path, fractions: list[float]) -> None:
    target, tokenizer, cfg, record, train, val = load_run(mix)
    bench = torch.load(bench_cache)
    print(f"{len(train)} training sequences ({sum(len(s['ids']) for s in train)} tokens), {len(val)} held back, "
          f"{len(bench)} bench answers", flush=True)
    print(f"draft model on the bench answers: {draft_top1(bench)}", flush=True)
    head, ids = load_head(mix)
    whole = trainer_for(target, head, ids, cfg, total_steps=1)
    print(f"fraction 1 (the mix-rc head as trained, {record['train_tokens']} tokens): {scores(whole, bench, val)}",
          flush=True)
    for fraction in fractions:
        subset = random.Random(f"subset-{fraction}").sample(train, round(fraction * len(train)))
        started = time.time()
        trainer = new_trainer(target, tokenizer, cfg, subset, cfg.epochs * len(subset))
        train_epochs(trainer, cfg, subset)
        tokens = sum(len(s["ids"]) for s in subset)
        print(f"fraction {fraction}: {len(subset)} sequences, {tokens} tokens, trained in {time.time() - started:.0f} "
              f"s; {scores(trainer, bench, val)}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]).expanduser(), Path(sys.argv[2]), [float(f) for f in sys.argv[3:]])
