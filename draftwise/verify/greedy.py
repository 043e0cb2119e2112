"""Greedy verification: keep the draft while it equals the target's argmax."""
from __future__ import annotations

import torch

from draftwise.sampling import argmax_ids
from draftwise.types import Verdict


def verify_greedy(draft_ids: list[int] | tuple[int, ...], target_logits: torch.Tensor) -> Verdict:
    """target_logits: [n + 1, vocab], row i scores the position of draft token i (row n: after all).

    The output is exactly the target's own greedy text: every kept token is the target's argmax,
    and the next token is the target's argmax after the kept prefix.
    """
    target_ids = argmax_ids(target_logits)  # [n + 1]
    accepted = 0
    for proposed, wanted in zip(draft_ids, target_ids):
        if proposed != wanted:
            break
        accepted += 1
    return Verdict(num_accepted=accepted, next_token=target_ids[accepted])
