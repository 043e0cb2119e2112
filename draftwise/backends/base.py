"""The protocol every backend keeps. A backend owns its KV cache; callers only see token ids."""
from __future__ import annotations

from typing import Protocol

import torch


class Backend(Protocol):
    vocab_size: int  # width of the logits rows
    max_context: int  # positions the model supports

    @property
    def cache_len(self) -> int:
        """Tokens held in the KV cache."""
        ...

    def prefill(self, token_ids: list[int]) -> None:
        """Start a new sequence: drop the cache and fill it with token_ids (no logits are returned)."""
        ...

    def forward(self, new_token_ids: list[int]) -> torch.Tensor:
        """Append tokens to the cache; return float32 logits [len(new_token_ids), vocab] for each."""
        ...

    def trim(self, to_len: int) -> None:
        """Drop cached positions from to_len on, so the cache holds exactly the first to_len tokens."""
        ...

    def keep(self, start: int, sources: list[int]) -> None:
        """Move the cached positions `sources` (ascending) to start, start + 1, ...: a token tree's kept path,
        written where a chain would have put it. Trim after it."""
        ...
