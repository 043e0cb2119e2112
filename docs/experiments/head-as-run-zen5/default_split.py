# The default head's training and held-back sequences as train-head splits them today (the installed packages give
# the corpus; every shard of the default run is already in the head's folder), for the scripts beside this one.
import json
from pathlib import Path
from draftwise.head import train as T
from draftwise.head.corpus import Piece, training_sequences
from draftwise.head.features import collect, load_shards

HEAD = Path.home() / ".cache/draftwise/heads/qwen2.5-coder-1.5b-instruct"


def default_split(tokenizer, folder: Path = HEAD) -> tuple[list[dict], list[dict]]:
    """(training sequences, held-back sequences), each with its answer_start."""
    cfg = T.TrainConfig()
    pieces = [Piece(**p) for p in json.loads((folder / "answers.json").read_text())["pieces"]]
    pieces += training_sequences(tokenizer, cfg.seq_len, cfg.max_tokens)
    data = load_shards(collect(None, [p.ids for p in pieces], folder / "features", progress=False))
    for sequence, piece in zip(data, pieces):
        sequence["answer_start"] = piece.answer_start
    held = [T._held_back(p.source) for p in pieces]
    return [s for s, h in zip(data, held) if not h], [s for s, h in zip(data, held) if h]
