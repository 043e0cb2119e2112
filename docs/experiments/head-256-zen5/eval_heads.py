"""Both heads on both held-back splits (the old run's and the new run's), with the trainer's own evaluate()."""
import json, sys
from pathlib import Path
import torch
from draftwise.loading import load_models
from draftwise.head.model import load_head, readout_layer
from draftwise.head.train import _Trainer, TrainConfig, _held_back
from draftwise.head.corpus import Piece, training_sequences
from draftwise.head.features import collect, load_shards

H = Path("/root/.cache/draftwise/heads")
old, new = Path(sys.argv[1]), Path(sys.argv[2])
m, tok, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
vocab = m.get_output_embeddings().weight.shape[0]

def val_of(folder, max_tokens=60000, seq_len=512):
    pieces = [Piece(**p) for p in json.loads((folder / "answers.json").read_text())["pieces"]]
    pieces += training_sequences(tok, seq_len, max_tokens)
    shards = collect(None, [p.ids for p in pieces], folder / "features", False)
    data = load_shards(shards)
    for s, p in zip(data, pieces):
        s["answer_start"] = p.answer_start
    return [s for s, p in zip(data, pieces) if _held_back(p.source)]

vals = {"old split": val_of(old), "new split": val_of(new)}
for folder in (old, new):
    head, ids = load_head(folder)
    trainer = _Trainer(head.float(), readout_layer(m, ids).float(), m.get_input_embeddings(), ids, vocab,
                       TrainConfig(), total_steps=1)
    for name, val in vals.items():
        print(folder.name, name, trainer.evaluate(val).line(), flush=True)
