"""The prompt cache: keys and values of texts already computed, reused by a later prompt that starts the same way.

A chat's second turn repeats the first turn and its answer; many requests share one system prompt. Causal
attention makes a position's keys and values depend only on the tokens up to it, so the cached entries of a
common prefix are exactly what a fresh prefill would compute there (up to float rounding of a differently
shaped pass, as with batching), and the new prompt prefills only what follows.

An entry is what one finished sequence held: its text (all but the last token) and a copy of its slot's
keys and values, per model ("target", "draft"), so the draft's cache is reused beside the target's; a feature
head's entry ("target features", features_entry) holds the target's features of the text instead, which a restored
prompt's prefill would otherwise never compute (a server capturing features keeps them there too). One byte budget
covers every model; the least recently used entries go first. A lookup takes the entry with the longest common
prefix, however the two texts go on after it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from draftwise.types import common_prefix

MIN_TOKENS = 16  # a shorter common prefix is not worth a lookup's copy


def features_entry(layers: tuple[int, ...] = ()) -> str:
    """The name of the target's features of a text in the prompt cache: the last layer's, and those of the decoder
    layers a fused head reads too (the target's hidden states hold both: every reader of them takes one name)."""
    return "target features" + (f" of layers {', '.join(map(str, layers))} and the last" if layers else "")


@dataclass
class PrefixEntry:
    token_ids: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer [kv_heads, len(token_ids), head_dim]; a head's: [[len(token_ids), F]]
    values: list[torch.Tensor]  # per layer, as keys; a head's: []
    nbytes: int


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    tokens_saved: int = 0  # prompt positions restored instead of prefilled


class PrefixCache:
    def __init__(self, max_bytes: int, min_tokens: int = MIN_TOKENS):
        if max_bytes < 0:
            raise ValueError(f"the prompt cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], PrefixEntry] = OrderedDict()  # oldest first
        self.nbytes = 0
        self.stats: dict[str, PrefixCacheStats] = {}

    def longest(self, model: str, token_ids: list[int], count: bool = True) -> tuple[PrefixEntry | None, int]:
        """The entry of `model` sharing the longest prefix with token_ids, and that prefix's length (None, 0
        when none shares min_tokens). Counts the lookup (unless count is False: a second reader of an entry
        already restored); the caller counts what it restores (saved)."""
        stats = self.stats.setdefault(model, PrefixCacheStats()) if count else PrefixCacheStats()
        stats.lookups += 1
        best, best_len = None, 0
        for (owner, _), entry in self._entries.items():
            if owner == model and (n := common_prefix(entry.token_ids, token_ids)) > best_len:
                best, best_len = entry, n
        if best is None or best_len < self.min_tokens:
            return None, 0
        self._entries.move_to_end((model, best.token_ids))
        stats.hits += 1
        stats.tokens_saved += best_len
        return best, best_len

    def put(self, model: str, token_ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep a copy of a text's keys and values (per layer [kv_heads, T, head_dim]); an entry that is a
        prefix of it is dropped (the new one serves every lookup it would), the oldest go while over budget."""
        ids = tuple(token_ids)
        nbytes = sum(t.numel() * t.element_size() for t in keys + values)
        if len(ids) < self.min_tokens or nbytes > self.max_bytes:
            return
        for key in [k for k in self._entries if k[0] == model and ids[: len(k[1])] == k[1]]:
            self._drop(key)
        self._entries[(model, ids)] = PrefixEntry(ids, keys, values, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, key) -> None:
        self.nbytes -= self._entries.pop(key).nbytes


