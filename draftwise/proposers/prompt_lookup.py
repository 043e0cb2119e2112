"""Prompt lookup: guess that the text continues as it did after the last place its tail occurred.

Free to run and strong on input-grounded text (summaries, code edits, RAG), where the output copies
spans of the prompt. The guess is one-hot, so Draft.q is None.
"""
from __future__ import annotations

import torch

from draftwise.config import SamplingConfig
from draftwise.errors import DraftwiseError
from draftwise.types import Draft


class PromptLookupProposer:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise DraftwiseError(f"lookup n-gram sizes must satisfy 1 <= min <= max, got min={min_ngram} max={max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._follower: dict[tuple[int, ...], int] = {}  # n-gram -> where its most recent continuation starts
        self._indexed = 0  # context positions already in the index

    def begin(self, prompt_ids: list[int], sampling: SamplingConfig, generator: torch.Generator) -> None:
        self._follower.clear()
        self._indexed = 0

    def propose(self, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
        self._index(context)
        # Longer matches first: a longer shared tail predicts the continuation better.
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            start = self._follower.get(tuple(context[-n:]))
            if start is not None:
                return Draft(token_ids=tuple(context[start : start + k]))
        return Draft(token_ids=())

    def observe(self, num_accepted: int) -> None:
        pass

    def fork(self) -> "PromptLookupProposer":
        return PromptLookupProposer(self.max_ngram, self.min_ngram)

    def release(self) -> None:
        pass

    def _index(self, context: list[int]) -> None:
        """Record, for every n-gram that now has a token after it, where that token is (O(new tokens))."""
        if len(context) < self._indexed:  # a different sequence: start over
            self._follower.clear()
            self._indexed = 0
        for follower in range(max(self._indexed, 1), len(context)):
            for n in range(self.min_ngram, min(self.max_ngram, follower) + 1):
                self._follower[tuple(context[follower - n : follower])] = follower
        self._indexed = max(self._indexed, len(context))
