"""The protocol every proposer keeps."""
from __future__ import annotations

from typing import Protocol

import torch

from draftwise.config import SamplingConfig
from draftwise.types import Draft


class Proposer(Protocol):
    def begin(self, prompt_ids: list[int], sampling: SamplingConfig, generator: torch.Generator) -> None:
        """Start a new sequence (drop any state of the previous one)."""
        ...

    def propose(self, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
        """Guess up to k tokens that follow context (prompt + everything emitted so far).

        A proposer that knows its confidence stops early once it falls below stop_confidence."""
        ...

    def observe(self, num_accepted: int) -> None:
        """The target kept the first num_accepted tokens of the last draft (0 when the round failed).

        Called after every propose, from the engine's `finally`: a proposer with a cache drops the rest here.
        """
        ...
