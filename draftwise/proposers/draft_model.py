"""A small draft model proposes k tokens, one forward each, from its own KV cache.

Cache rule: the draft cache holds a prefix of the text. After a round, observe() cuts it to the
context plus the accepted draft tokens it holds, so after a rejection at i it keeps d1..di, and
after full acceptance the last draft token (never fed) is fed next round with the bonus token.
"""
from __future__ import annotations

import torch

from draftwise.backends.base import Backend
from draftwise.config import SamplingConfig
from draftwise.sampling import logits_to_probs, sample
from draftwise.types import Draft


class DraftModelProposer:
    def __init__(self, backend: Backend, target_vocab_size: int, token_ids: torch.Tensor | None = None):
        """token_ids: the target id of each draft logit, for a draft whose output layer keeps only some tokens
        (see compact.py); None when the draft's logits are indexed by the target's ids."""
        self.backend = backend
        self.target_vocab_size = target_vocab_size
        self.token_ids = token_ids
        self._cached: list[int] = []  # exactly the tokens in the draft's KV cache
        self._context_len = 0  # length of the context of the last propose
        self._sampling = SamplingConfig()
        self._generator: torch.Generator | None = None

    def begin(self, prompt_ids: list[int], sampling: SamplingConfig, generator: torch.Generator) -> None:
        self._sampling, self._generator = sampling, generator
        self._cached = list(prompt_ids[:-1])
        self.backend.prefill(self._cached)

    def propose(self, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
        # observe() keeps the cache a prefix of the text, so only the newest tokens need feeding.
        self._context_len = len(context)
        feed = context[len(self._cached) :]  # >= 1 token: the last one is never cached yet
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        try:
            for _ in range(k):
                logits = self.backend.forward(feed)[-1]  # [draft_vocab]
                self._cached += feed
                token, q, confidence = self._choose(logits, want_confidence=stop_confidence > 0)
                tokens.append(token)
                if q is not None:
                    qs.append(q)
                feed = [token]
                if confidence < stop_confidence:  # the next guesses would build on a doubtful one
                    break
        finally:
            # Whatever happened, the cache must hold exactly self._cached.
            self.backend.trim(len(self._cached))
        return Draft(token_ids=tuple(tokens), q=torch.stack(qs) if qs else None)

    def observe(self, num_accepted: int) -> None:
        # The cache holds the context and d1..d(k-1); drop the draft tokens the target did not keep.
        del self._cached[self._context_len + num_accepted :]
        self.backend.trim(len(self._cached))

    def _choose(self, logits: torch.Tensor, want_confidence: bool) -> tuple[int, torch.Tensor | None, float]:
        """(target token id, q or None when greedy, the draft's probability of that token; 1.0 when not wanted).

        Greedy needs no target-width logits: the argmax of the draft's own row, mapped to a target id."""
        if self._sampling.greedy:
            if self.token_ids is None:
                logits = logits[: self.target_vocab_size]  # rows past the target's vocabulary are padding
            best = int(logits.argmax())
            confidence = float(torch.softmax(logits, -1)[best]) if want_confidence else 1.0
            return (best if self.token_ids is None else int(self.token_ids[best])), None, confidence
        q = logits_to_probs(self._fit_vocab(logits), self._sampling)  # [target_vocab]
        token = sample(q, self._generator)
        return token, q, float(q[token])

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Match the target's logit width: rows past the tokenizer are padding, never proposed."""
        if self.token_ids is not None:  # a compact output layer: scatter back; the tokens it dropped get -inf
            full = logits.new_full((self.target_vocab_size,), float("-inf"))  # [target_vocab]
            return full.index_copy_(0, self.token_ids, logits)
        extra = self.target_vocab_size - logits.shape[-1]
        if extra > 0:
            return torch.cat([logits, logits.new_full((extra,), float("-inf"))])
        return logits[: self.target_vocab_size]
