"""Data that flows between the layers: drafts, verdicts, stream events."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from draftwise.metrics import Stats


@dataclass(frozen=True)
class Draft:
    """What a proposer guesses for the next positions.

    A chain today: token_ids[i] is the guess for position i after the context. q[i] is the
    distribution it was drawn from, [n, vocab]; q is None for a one-hot guess (prompt lookup)
    or in greedy mode. A tree draft will add its own paths beside these fields; consumers read
    only `token_ids`/`q` through the verifier, so a chain is not baked into what they import.
    """

    token_ids: tuple[int, ...]
    q: torch.Tensor | None = None  # [n, vocab] float32, or None for one-hot guesses

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Verdict:
    """The verifier's answer: how many draft tokens to keep, and the target's next token."""

    num_accepted: int
    next_token: int  # recovered (after a rejection) or bonus (after full acceptance)


@dataclass(frozen=True)
class Event:
    """One step of `Engine.stream`: a token, the text it completed, and where it came from.

    A token's event carries the text that became safe to show with it (text held back for a
    possible stop string or an unfinished character comes later; the last token's event flushes
    it). After the last token, one more event with token_id None carries the finish reason
    ("eos", "stop", "length"; in the server also "cancelled" and "error") and the run's stats.
    """

    token_id: int | None
    text: str
    from_draft: bool = False
    finish_reason: str | None = None
    stats: Stats | None = None  # on the last event
    error: str | None = None  # on the last event when finish_reason is "error": what went wrong
