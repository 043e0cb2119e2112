"""The target's features over the training corpus, collected once and kept as shards beside the head.

Per sequence: its token ids [L], the target's last hidden state after the final norm at every position
[L, H] (what its output layer reads, in the dtype the target runs in; a fused head's chosen layers' outputs
before it, [L, (layers + 1) H]), and the target's own greedy next token
at every position [L] (the label the head's accuracy is judged by). A shard is written whole or not at all
and named by its sequences' content, so an interrupted collection resumes at the first missing shard.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from draftwise.backends.hf import last_hidden_states
from draftwise.files import write_whole

SHARD_SEQUENCES = 16


@torch.inference_mode()
def target_features(model, ids: list[int], layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [L, H], or [L, (layers + 1) H] with those layers' outputs first; the target's argmax next token
    [L]) for one sequence."""
    input_ids = torch.tensor([ids], device=model.device)  # [1, L]
    with last_hidden_states(model, layers=layers) as captured:
        logits = model(input_ids=input_ids, use_cache=False).logits[0]  # [L, vocab]
    return captured[0][0].cpu(), logits.argmax(-1).to(torch.int32).cpu()


def collect(model, sequences: list[list[int]], folder: Path, progress: bool = True,
            layers: tuple[int, ...] = ()) -> list[Path]:
    """Write the shards of `sequences` under folder (those already there are kept); returns every shard's path.
    layers: decoder layers whose outputs go beside the last hidden state (target_features)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    starts = range(0, len(sequences), SHARD_SEQUENCES)
    tokens = sum(map(len, sequences))
    with tqdm(total=tokens, unit="tok", desc="target features", disable=not progress, dynamic_ncols=True) as bar:
        for start in starts:
            batch = sequences[start : start + SHARD_SEQUENCES]
            # Named by content: a run over a changed corpus recomputes only the shards whose sequences changed.
            digest = hashlib.sha256(json.dumps(batch).encode()).hexdigest()[:16]
            path = folder / f"shard-{digest}.safetensors"
            if not path.is_file():
                tensors = {}
                for i, ids in enumerate(batch):
                    features, next_ids = target_features(model, ids, layers)
                    tensors.update({f"ids.{i}": torch.tensor(ids, dtype=torch.int32), f"features.{i}": features,
                                    f"next.{i}": next_ids})
                    bar.update(len(ids))
                write_whole(path, lambda p: save_file(tensors, str(p)))
            else:
                bar.update(sum(map(len, batch)))
            paths.append(path)
    return paths


def load_shards(paths: list[Path]) -> list[dict[str, torch.Tensor]]:
    """Every sequence of the shards: {"ids": [L] long, "features": [L, H], "next": [L] long}, and "answer_start"
    where the shard holds it (a server's captured request: serve/feature_capture.py)."""
    out = []
    for path in paths:
        tensors = load_file(str(path))
        for i in range(sum(name.startswith("ids.") for name in tensors)):
            out.append({"ids": tensors[f"ids.{i}"].long(), "features": tensors[f"features.{i}"],
                        "next": tensors[f"next.{i}"].long()})
            if f"answer_start.{i}" in tensors:
                out[-1]["answer_start"] = int(tensors[f"answer_start.{i}"][0])
    return out
