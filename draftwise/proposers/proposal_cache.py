"""The proposal cache: the texts of earlier requests (prompts and outputs), indexed by their n-grams, so that prompt
lookup can propose a continuation seen in another request, not only in its own text.

Templated traffic (an agent's tool calls, a form-filling service, the same question about many records) repeats
whole spans across requests that no single prompt contains; SuffixDecoding (Oliaro et al. 2024) drafts them from
a suffix tree over past outputs. This is the same idea at the size a CPU server needs: a dict from each n-gram
(n in NGRAMS) to where its continuation starts in the newest text that has it (at its first occurrence there,
the longest guess), over a bounded window of whole texts. Proposals are
one-hot guesses like prompt lookup's, so exactness is the verifier's as for any lookup draft.

Bounded by tokens: when a new text would pass max_tokens, the oldest texts go, and with them every index entry
that still points into them.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

NGRAMS = (2, 3, 4)  # a single shared token across requests predicts nothing
DEFAULT_MAX_TOKENS = 262_144


class ProposalCache:
    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, ngrams: tuple[int, ...] = NGRAMS):
        if max_tokens < 1:
            raise ValueError(f"the proposal cache must hold at least 1 token, got {max_tokens}")
        self.max_tokens, self.ngrams = max_tokens, tuple(sorted(ngrams, reverse=True))
        self._texts: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # oldest first
        self._follower: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (text id, start of what follows)
        self._next_id = 0
        self.tokens = 0
        self._lock = threading.Lock()  # texts are added as requests end; lookups run on the model thread

    def add(self, token_ids: list[int]) -> None:
        """Keep a finished text (prompt and output) for later lookups; the oldest texts go to make room."""
        text = tuple(token_ids[-self.max_tokens:])
        if len(text) <= min(self.ngrams):
            return
        with self._lock:
            while self._texts and self.tokens + len(text) > self.max_tokens:
                self._evict_oldest()
            text_id, self._next_id = self._next_id, self._next_id + 1
            self._texts[text_id] = text
            self.tokens += len(text)
            # Backwards, so an n-gram's first occurrence in the newest text is the one kept: the longest guess.
            for follower in range(len(text) - 1, 0, -1):
                for n in self.ngrams:
                    if n <= follower:
                        self._follower[text[follower - n: follower]] = (text_id, follower)

    def match(self, context: list[int], k: int) -> tuple[int, tuple[int, ...]]:
        """(n, up to k tokens that followed the longest n-gram ending the context), or (0, ()) without a match."""
        with self._lock:
            for n in self.ngrams:
                if n > len(context):
                    continue
                hit = self._follower.get(tuple(context[-n:]))
                if hit is not None:
                    text_id, start = hit
                    return n, self._texts[text_id][start: start + k]
        return 0, ()

    def __len__(self) -> int:
        return len(self._texts)

    def _evict_oldest(self) -> None:
        text_id, text = self._texts.popitem(last=False)
        self.tokens -= len(text)
        for follower in range(1, len(text)):
            for n in self.ngrams:
                key = text[follower - n: follower] if n <= follower else None
                if key is not None and self._follower.get(key, (None,))[0] == text_id:
                    del self._follower[key]
