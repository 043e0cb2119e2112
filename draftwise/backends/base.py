"""The protocols every backend keeps. A backend owns its KV cache; callers only see token ids.

Two faces of one model: `SharedBackend` is the model that many sequences share (the engine's target, a draft
model under load), and each sequence holds a `Backend`, its own slot of that model's cache, opened from it.
HFBackend and its SlotView (hf.py) are the first pair (HFBackend's single-sequence methods, close aside, act on
its `default` slot, so a proposer that runs one sequence at a time takes it as it is); layer skipping's SkippingBackend (proposers/layer_skip.py) is the target's
forward_batch run with layers skipped, over views of the target's own slots."""
from __future__ import annotations

from typing import Protocol

import torch


class Backend(Protocol):
    """One sequence's cache on a model: what the engine and the proposers call for a single sequence."""

    vocab_size: int  # width of the logits rows
    max_context: int  # positions the model supports

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def cache_len(self) -> int:
        """Tokens held in the KV cache."""
        ...

    def prefill(self, token_ids: list[int]) -> None:
        """Start a new sequence: drop the cache and fill it with token_ids (no logits are returned)."""
        ...

    def append(self, token_ids: list[int], hidden: bool = False) -> torch.Tensor | None:
        """Extend the cache with token_ids, no logits (a prefill or a chunk of one); hidden: return the last hidden
        states [n, H] too, for a proposer that drafts from them (the feature head)."""
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

    def restore(self, token_ids: list[int]) -> int:
        """Fill the cache from the prompt cache's longest entry sharing a prefix with token_ids; returns how many
        positions it now holds (0: nothing cached, the cache is left empty)."""
        ...

    def remember(self, token_ids: list[int]) -> None:
        """Offer the cache's first positions, those of token_ids' first ones, to the prompt cache."""
        ...

    def close(self) -> None:
        """Give the slot back to the shared model: the sequence has ended."""
        ...


class SharedBackend(Protocol):
    """A model many sequences share: each opens its own slot, and one forward serves a ragged batch of them."""

    vocab_size: int
    max_context: int
    default: Backend  # a slot opened at construction, for code that runs one sequence at a time
    backend_name: str  # "hf", "llamacpp": which methods it serves (methods.BACKENDS)

    @property
    def embedding_rows(self) -> int:
        """The ids the model's input embedding reads."""
        ...

    @property
    def open_slots(self) -> int: ...

    def open_slot(self) -> Backend: ...

    def close_slot(self, view: Backend) -> None: ...

    def forward_batch(self, rows: list[tuple[Backend, list[int]]], logits: bool = True, trees: list | None = None,
                      hidden: bool = False):
        """Append each row's new ids to its slot; return float32 logits [n_i, vocab] per row (and, with hidden,
        the rows' last hidden states). Lengths move only once the whole pass has succeeded; trees: per row, None
        or the TreeLayout its ids are scored as (types.py)."""
        ...


class OnDefaultSlot:
    """A SharedBackend's single-sequence methods, acting on its `default` slot: code that runs one sequence at a
    time (a proposer's own draft model) takes the shared model as it is, with no slot of its own."""

    default: Backend

    @property
    def cache_len(self) -> int:
        return self.default.cache_len

    def prefill(self, token_ids: list[int]) -> None:
        self.default.prefill(token_ids)

    def forward(self, new_token_ids: list[int]) -> torch.Tensor:
        return self.default.forward(new_token_ids)

    def append(self, token_ids: list[int], hidden: bool = False) -> torch.Tensor | None:
        return self.default.append(token_ids, hidden)

    def trim(self, to_len: int) -> None:
        self.default.trim(to_len)

    def keep(self, start: int, sources: list[int]) -> None:
        self.default.keep(start, sources)

    def restore(self, token_ids: list[int]) -> int:
        return self.default.restore(token_ids)

    def remember(self, token_ids: list[int]) -> None:
        self.default.remember(token_ids)
