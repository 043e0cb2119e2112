"""A small draft model proposes k tokens, one forward each, from its own KV cache.

Cache rule: the draft cache holds a prefix of the text. After a round, observe() cuts it to the
context plus the accepted draft tokens it holds, so after a rejection at i it keeps d1..di, and
after full acceptance the last draft token (never fed) is fed next round with the bonus token.
"""
from __future__ import annotations

import torch

from draftwise.backends.base import Backend, SharedBackend, SlotView
from draftwise.config import SamplingConfig
from draftwise.proposers.base import Capabilities, Proposer
from draftwise.proposers.batch import run_round
from draftwise.sampling import argmax_ids, logits_to_probs, sample
from draftwise.types import Draft


class DraftModelProposer(Proposer):
    capabilities = Capabilities(needs_draft_model=True, drafts_in_steps=True, keeps_cache=True)

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
        self._feed: list[int] | None = None  # tokens the round's next draft forward appends
        self._left, self._stop_confidence = 0, 0.0
        self._tokens: list[int] = []
        self._qs: list[torch.Tensor] = []
        self._guide = None  # the sequence's grammar (follow_grammar), None without one
        self._noise = None  # a seeded sampled sequence's (share_noise), None for any other

    def follow_grammar(self, guide) -> None:
        self._guide = guide

    def share_noise(self, noise) -> None:
        self._noise = noise

    def begin(self, prompt_ids: list[int], sampling: SamplingConfig, generator: torch.Generator) -> None:
        """Start a sequence with an empty cache: extend() prefills it (in chunks, if the caller wants), and
        whatever is not cached by the first propose() is fed then."""
        self._sampling, self._generator = sampling, generator
        self._cached = []
        self.backend.trim(0)

    def extend(self, token_ids: list[int]) -> None:
        """Prefill: append text the cache does not hold yet (no logits needed)."""
        self.backend.append(token_ids)
        self._cached += token_ids

    def behind(self, context: list[int]) -> int:
        """Tokens of the text (but its last, which every round feeds) that the cache does not hold yet: a
        sequence that went rounds without drafting (k = 0) lets its draft fall behind, and catches it up with
        extend() or in its next round's first forward."""
        return max(0, len(context) - 1 - len(self._cached))

    def restore(self, token_ids: list[int]) -> int:
        """Fill the cache from the prompt cache's longest entry sharing a prefix with token_ids; returns how many
        of them it now holds (the engine prefills the rest)."""
        cached = self.backend.restore(token_ids)
        self._cached = list(token_ids[:cached])
        return cached

    def remember(self, text: list[int]) -> None:
        """Offer what the cache holds to the prompt cache (when the sequence ends): its own record of its tokens,
        which may run past the text (drafts kept beyond a stop string)."""
        self.backend.remember(self._cached)

    def propose(self, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
        return run_round(self, context, k, stop_confidence)

    # A round in steps, so that many sequences' drafts can share each draft forward (proposers/batch.py):
    # start(); while pending() gives tokens to feed: take(the logits row after them); settle(); finish().
    def start(self, context: list[int], k: int, stop_confidence: float = 0.0) -> None:
        # observe() keeps the cache a prefix of the text, so only the newest tokens need feeding.
        self._context_len = len(context)
        self._feed = context[len(self._cached) :] if k > 0 else None  # >= 1 token: the last one is never cached
        self._left, self._stop_confidence = k, stop_confidence
        self._tokens, self._qs = [], []

    def pending(self) -> list[int] | None:
        """The tokens the next draft forward must append, or None when the round's draft is complete."""
        return self._feed

    def take(self, logits: torch.Tensor) -> None:
        """logits: [draft_vocab], the draft's row after the pending tokens (which the backend has cached)."""
        self._cached += self._feed
        self._feed = None
        if self._guide is not None:
            logits = self._within_grammar(logits)
        token, q, confidence = self._choose(logits, want_confidence=self._stop_confidence > 0)
        if self._guide is not None and not self._guide.push(token):
            return  # nothing the grammar allows in the draft's vocabulary: the draft ends here
        self._tokens.append(token)
        if q is not None:
            self._qs.append(q)
        self._left -= 1
        # Below the confidence cut, the next guesses would build on a doubtful one.
        if self._left > 0 and confidence >= self._stop_confidence:
            self._feed = [token]

    def settle(self) -> None:
        """Whatever happened in the round, the cache must hold exactly self._cached (and a grammar's matcher the
        text alone)."""
        self._feed = None
        self._end_guided_round()
        self.backend.trim(len(self._cached))

    def _end_guided_round(self) -> None:
        """The grammar's matcher back at the text: every settle() calls it (a subclass's own too)."""
        if self._guide is not None:
            self._guide.reset()

    def finish(self) -> Draft:
        return Draft(token_ids=tuple(self._tokens), q=torch.stack(self._qs) if self._qs else None)

    def fork(self) -> "DraftModelProposer":
        """A proposer for another sequence: its own slot of the same draft model."""
        return self.fork_on_draft_model(DraftModelProposer)

    def fork_on_draft_model(self, proposer_cls: type) -> "DraftModelProposer":
        return proposer_cls(self._model().open_slot(), self.target_vocab_size, self.token_ids)

    def _model(self) -> SharedBackend:
        """The draft model's backend, which every slot of it shares (a bare backend is its own default slot)."""
        return self.backend.backend if isinstance(self.backend, SlotView) else self.backend

    def attach_prompt_cache(self, cache) -> None:
        # (the engine's own proposer: the model's default slot), on a backend that keeps one
        if isinstance(self.backend, SharedBackend) and self.backend.capabilities.prompt_cache:
            self.backend.attach_prompt_cache(cache, "draft")

    def release(self) -> None:
        if isinstance(self.backend, SlotView):  # (the default slot is the model's own, never given back)
            self.backend.close()

    def observe(self, num_accepted: int) -> None:
        # The cache holds the context and d1..d(k-1); drop the draft tokens the target did not keep.
        del self._cached[self._context_len + num_accepted :]
        self.backend.trim(len(self._cached))

    def _choose(self, logits: torch.Tensor, want_confidence: bool) -> tuple[int, torch.Tensor | None, float]:
        """(target token id, q or None when greedy, the draft's probability of that token; 1.0 when not wanted).

        Greedy needs no target-width logits: the argmax of the draft's own row, mapped to a target id. With shared
        noise, the token the draft's own race on the target's clocks names at its position (shared_noise.py)."""
        if self._noise is not None:
            fitted = self._fit_vocab(logits)  # [target_vocab]
            token = self._noise.draws(fitted[None], [self._context_len + len(self._tokens)])[0]
            confidence = float(logits_to_probs(fitted, self._noise.sampling)[token]) if want_confidence else 1.0
            return token, None, confidence
        if self._sampling.greedy:
            if self.token_ids is None:
                logits = logits[: self.target_vocab_size]  # rows past the target's vocabulary are padding
            best = argmax_ids(logits[None])[0]
            confidence = float(torch.softmax(logits, -1)[best]) if want_confidence else 1.0
            return (best if self.token_ids is None else int(self.token_ids[best])), None, confidence
        q = logits_to_probs(self._fit_vocab(logits), self._sampling)  # [target_vocab]
        token = sample(q, self._generator)
        return token, q, float(q[token])

    def _within_grammar(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits ([draft_vocab]) with what the grammar forbids at the next position at -inf."""
        allowed = self._guide.allowed()  # [target_vocab] bool
        if self.token_ids is not None:  # a compact output layer: its rows' target ids
            return logits.masked_fill(~allowed[self.token_ids], float("-inf"))
        rows = logits.shape[-1]
        if rows > len(allowed):  # (padding rows past the vocabulary: never allowed)
            allowed = torch.cat([allowed, allowed.new_zeros(rows - len(allowed))])
        return logits.masked_fill(~allowed[:rows], float("-inf"))

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Match the target's logit width: rows past the tokenizer are padding, never proposed."""
        if self.token_ids is not None:  # a compact output layer: scatter back; the tokens it dropped get -inf
            full = logits.new_full((self.target_vocab_size,), float("-inf"))  # [target_vocab]
            return full.index_copy_(0, self.token_ids, logits)
        extra = self.target_vocab_size - logits.shape[-1]
        if extra > 0:
            return torch.cat([logits, logits.new_full((extra,), float("-inf"))])
        return logits[: self.target_vocab_size]
