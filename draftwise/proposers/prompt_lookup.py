"""Prompt lookup: guess that the text continues as it did after the last place its tail occurred.

Free to run and strong on input-grounded text (summaries, code edits, RAG), where the output copies
spans of the prompt. The guess is one-hot, so Draft.q is None.

With a proposal cache (proposal_cache.py, shared by the engine's sequences) the text of earlier requests is
searched too: the longer of the two matches proposes, the request's own text on a tie (it is the more specific).
"""
from __future__ import annotations

import torch

from draftwise.config import SamplingConfig
from draftwise.errors import DraftwiseError
from draftwise.proposers.proposal_cache import ProposalCache
from draftwise.types import Draft


class PromptLookupProposer:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, corpus: ProposalCache | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise DraftwiseError(f"lookup n-gram sizes must satisfy 1 <= min <= max, got min={min_ngram} max={max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.corpus = corpus  # earlier requests' texts, or None
        self.corpus_rounds = 0  # proposals this sequence took from the corpus
        self._use_corpus = True
        self._follower: dict[tuple[int, ...], int] = {}  # n-gram -> where its most recent continuation starts
        self._indexed = 0  # context positions already in the index

    def begin(self, prompt_ids: list[int], sampling: SamplingConfig, generator: torch.Generator) -> None:
        self._follower.clear()
        self._indexed = 0
        self.corpus_rounds = 0
        # A seeded sampled sequence must give the same text every time: its random draws follow the round shapes,
        # which other requests' texts would change. It looks up its own text only.
        self._use_corpus = sampling is None or sampling.greedy or sampling.seed is None

    def propose(self, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
        n, guess = self._own_match(context, k)
        if self.corpus is not None and self._use_corpus:
            corpus_n, corpus_guess = self.corpus.match(context, k)
            if corpus_n > n and corpus_n >= self.min_ngram and corpus_guess:
                self.corpus_rounds += 1
                return Draft(token_ids=corpus_guess)
        return Draft(token_ids=guess)

    def _own_match(self, context: list[int], k: int) -> tuple[int, tuple[int, ...]]:
        """(n, the tokens after the most recent earlier occurrence of the context's last n) for the longest n."""
        self._index(context)
        # Longer matches first: a longer shared tail predicts the continuation better.
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            start = self._follower.get(tuple(context[-n:]))
            if start is not None:
                return n, tuple(context[start : start + k])
        return 0, ()

    def observe(self, num_accepted: int) -> None:
        pass

    def fork(self) -> "PromptLookupProposer":
        return PromptLookupProposer(self.max_ngram, self.min_ngram, self.corpus)

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
