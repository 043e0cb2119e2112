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

    def propose(self, context: list[int], k: int) -> Draft:
        """Guess up to k tokens that follow context (prompt + everything emitted so far)."""
        ...

    def observe(self, num_accepted: int) -> None:
        """Learn how many of the last draft's tokens the target kept."""
        ...
