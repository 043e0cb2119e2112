"""The held-back split scored as the engine runs the head: through the engine's own proposer (loading.head_proposer:
the target's dtype, the kernels timed for this machine, the attention window), one position a call.

Why: training's validation runs the head in float32, hundreds of rows a call, and the engine does not. The two can
disagree where a kernel changes values only for narrow calls: int8-dynamic quantizes calls of at most
DYNAMIC_MAX_ROWS rows and runs wider ones on the float weight. Run on the head's fuse, its one activation scale
per call, set by the target feature's few huge dimensions, rounds the next token's embedding away: the engine's
guesses get worse while validation, on wide calls, does not see it (which is why loading.py keeps the fuse off
int8-dynamic). Scored here, such a gap shows in the run that trains the head.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from draftwise.config import SamplingConfig
from draftwise.loading import head_proposer

GAP_WARNING = 0.02  # top-1 this far below training's validation is more than batch rounding: the engine's path differs


def top1_as_run(target_model, folder: Path, sequences: list[dict], progress: bool = True) -> dict:
    """{"top1", "tokens", "kernels"}: at every scored position of the sequences (those training's validation scores:
    each answer token and the one after the answer's last), whether the head's first draft token is the target's
    greedy token, the head loaded from folder as the engine loads it and fed the target's true features a position
    at a time, as a round that kept one token feeds them."""
    proposer = head_proposer(target_model, str(folder))
    hits = scored = 0
    with tqdm(total=sum(len(s["ids"]) - _first_scored(s) for s in sequences), desc="validation as run", unit="tok",
              disable=not progress, dynamic_ncols=True) as bar:
        for sequence in sequences:
            wanted = sequence["next"].tolist()
            for last, guess in first_guesses(proposer, sequence):
                hits += bool(guess) and guess[0] == wanted[last]
                scored += 1
                bar.update(1)
    return {"top1": hits / max(1, scored), "tokens": scored, "kernels": proposer.speed_paths["kernels"]}


def first_guesses(proposer, sequence: dict) -> Iterator[tuple[int, list[int]]]:
    """(last, the head's first draft token, or [] for none) at every scored position of sequence: the head reads
    f_{last - 1} and x_last and guesses the target's token after x_last (sequence["next"][last]), fed the target's
    true features a position at a time, as a round that kept one token feeds them."""
    ids, features = sequence["ids"].tolist(), sequence["features"]
    first = _first_scored(sequence)
    proposer.begin(ids[: first + 1], SamplingConfig(), torch.Generator())
    proposer.add_features(0, features[:first])  # [first, F]: f_0 .. f_{first - 1}
    for last in range(first, len(ids)):
        if last > first:
            proposer.add_features(last - 1, features[last - 1 : last])
        yield last, proposer.propose(ids[: last + 1], 1).token_ids


def _first_scored(sequence: dict) -> int:
    """The first position whose next token validation scores: the answer's first token is next after the one
    before it (and position 0 has no feature before it to read)."""
    return max(1, sequence.get("answer_start", 0) - 1)


def gap_line(as_run: dict, trained_top1: float) -> str:
    """The log line for the as-run score beside training's own."""
    line = (f"validation as the engine runs the head (its dtype and kernels, one position a call): top-1 "
            f"{100 * as_run['top1']:.1f}% over {as_run['tokens']} tokens (training's validation: "
            f"{100 * trained_top1:.1f}%)")
    if as_run["top1"] < trained_top1 - GAP_WARNING:
        line += ("; the engine's path loses accuracy the training did not: a kernel that changes values for narrow "
                 f"calls? kernels: {as_run['kernels']}")
    return line
