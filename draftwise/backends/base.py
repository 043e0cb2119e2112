"""The contract every backend keeps. A backend owns its KV cache; callers only see token ids.

Two faces of one model: `SharedBackend` is the model that many sequences share (the engine's target, a draft
model under load), and each sequence holds a `Backend`, its own slot of that model's cache, opened from it.

Every backend class derives from SharedBackend and implements the same members with the same signatures: hf.py
(HFBackend), quant.py (QuantBackend), llamacpp.py (LlamaCppBackend) and skipping.py (SkippingBackend, the target's
forward_batch run with layers skipped, over views of the target's own slots). What each can do is data on its
class (`capabilities`, capabilities.py); asked for what it does not declare, a backend raises a DraftwiseError.
SharedBackend is an abstract base class, so a backend missing a member cannot be made at all, and
tests/test_backend_contract.py runs every backend through the same calls and fails on a public member that this
contract does not name. A shared backend's single-sequence methods act on its `default` slot, so a proposer that
runs one sequence at a time takes it as it is."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol, runtime_checkable

import torch

from draftwise.backends.capabilities import BackendCapabilities


@runtime_checkable
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
        positions it now holds (0: nothing cached, or no prompt cache attached; the cache is left empty)."""
        ...

    def remember(self, token_ids: list[int]) -> None:
        """Offer the cache's first positions, those of token_ids' first ones, to the prompt cache (none attached:
        nothing is kept)."""
        ...

    def close(self) -> None:
        """Give the slot back to the shared model: the sequence has ended."""
        ...


class SharedBackend(ABC):
    """A model many sequences share: each opens its own slot, and one forward serves a ragged batch of them.

    Its own single-sequence methods (Backend's, close aside) act on `default`, a slot opened at construction."""

    backend_name: ClassVar[str]  # "hf", "quant", "llamacpp": the --backend choice it is (methods.BACKENDS)
    capabilities: ClassVar[BackendCapabilities]  # what it can do, as data (capabilities.py)
    vocab_size: int  # width of the logits rows
    max_context: int  # positions the model supports
    default: Backend  # a slot opened at construction, for code that runs one sequence at a time
    # Decoder layers whose outputs forward_batch(hidden=True) returns too, before the last hidden state (a fused
    # feature head's); set by loading.assemble. Empty: the last hidden state alone.
    feature_layers: tuple[int, ...]

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def embedding_rows(self) -> int:
        """The ids the model's input embedding reads."""

    @property
    @abstractmethod
    def open_slots(self) -> int:
        """Slots open now, the default one included."""

    @property
    @abstractmethod
    def model(self):
        """The torch module it runs, for code that reaches into its layers (layer skipping's calibration and
        drafting, training a head on the target): capabilities.layer_access. A backend without one raises."""

    @abstractmethod
    def open_slot(self) -> Backend:
        """A new, empty slot for one sequence."""

    @abstractmethod
    def close_slot(self, view: Backend) -> None:
        """Give a slot back (view.close() calls it); closing one twice does nothing."""

    @abstractmethod
    def forward_batch(self, rows: list[tuple[Backend, list[int]]], logits: bool = True, trees: list | None = None,
                      hidden: bool = False):
        """Append each row's new ids to its slot; return float32 logits [n_i, vocab] per row (empty [0, vocab] when
        not logits: a prefill needs only the cache), and with hidden, (logits per row, the rows' last hidden states
        [n_i, H] per row). Lengths move only once the whole pass has succeeded. trees: per row, None or the
        TreeLayout its ids are scored as (types.py); capabilities.trees and .hidden_states say whether they are
        served."""

    @abstractmethod
    def attach_prompt_cache(self, cache, name: str) -> None:
        """Restore and remember this model's slots through cache (a PrefixCache, prefix_cache.py) under name
        ("target", "draft"): capabilities.prompt_cache."""

    @abstractmethod
    def close(self) -> None:
        """Free what the model holds outside Python's memory (llama.cpp's context); its slots go with it."""

    # -- one sequence at a time, on the default slot ------------------------------------------------------------
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


class SlotView(ABC):
    """One sequence's view of a shared backend: the single-sequence methods on its own slot, each a forward_batch
    of one row (so a backend's rules for a pass, its padding and invariance, hold for them too). A backend's own
    slot class adds what touches its cache directly: keep and, where it has a prompt cache, restore and remember.

    backend: the shared model it is a slot of; slot: its handle on that model's cache (what forward_batch reads)."""

    def __init__(self, backend: SharedBackend, slot):
        self.backend = backend
        self.slot = slot

    vocab_size = property(lambda self: self.backend.vocab_size)
    max_context = property(lambda self: self.backend.max_context)
    device = property(lambda self: self.backend.device)
    dtype = property(lambda self: self.backend.dtype)

    @property
    def cache_len(self) -> int:
        return self.slot.length

    def prefill(self, token_ids: list[int]) -> None:
        self.slot.length = 0
        self.append(token_ids)

    def append(self, token_ids: list[int], hidden: bool = False) -> torch.Tensor | None:
        """Extend the cache with token_ids, no logits: a prefill (or a chunk of one). hidden: return the last
        hidden states [n, H] too (a feature head drafts from them)."""
        if not token_ids:
            return None
        # Only the cache matters here, so skip the vocab-wide projection of every prompt position.
        out = self.backend.forward_batch([(self, token_ids)], logits=False, hidden=hidden)
        return out[1][0] if hidden else None

    def forward(self, new_token_ids: list[int]) -> torch.Tensor:
        return self.backend.forward_batch([(self, new_token_ids)])[0]  # [n, vocab]

    def trim(self, to_len: int) -> None:
        self.slot.length = min(self.slot.length, to_len)

    def close(self) -> None:
        self.backend.close_slot(self)

    @abstractmethod
    def keep(self, start: int, sources: list[int]) -> None: ...

    # -- the prompt cache, where none is attached (a backend with one overrides these) -----------------------
    def restore(self, token_ids: list[int]) -> int:
        self.slot.length = 0
        return 0

    def remember(self, token_ids: list[int]) -> None:
        """Nothing to offer it to."""
