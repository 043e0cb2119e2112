"""Hybrid: each round, prompt lookup proposes when the text's tail has a long enough earlier match; the draft
model proposes otherwise.

Lookup is free and strong where the output copies the input (summaries, code edits, RAG); the draft model
covers the free text in between. This wraps the two proposers as they are; it only picks one per round.

Cache rule: observe() goes only to the proposer that made the last proposal, because the draft model's
observe() cuts its cache relative to the context of *its* last propose. While lookup proposes, the draft
model's cache stays where it was (a shorter prefix of the text); its next propose feeds every context token it
has not cached, in one forward, so it catches up on its own.

Exactness: the choice depends on the context alone, and the verifier handles both kinds of draft per round
(a lookup draft is one-hot, Draft.q None; a draft-model draft carries q under sampling).
"""
from __future__ import annotations

import torch

from draftwise.config import SamplingConfig
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.prompt_lookup import PromptLookupProposer
from draftwise.types import Draft

# Lookup replaces the draft model only on evidence of copying: a match of the text's last MIN_NGRAM tokens.
# A shorter shared tail (one token, a common pair such as ", the") recurs in any prose, and what followed it
# there is mostly wrong here, where the draft model is usually right.
MIN_NGRAM = 3
# A lookup guess of one token (the match ends right before the tail, as in a loop) keeps at most one token,
# where the draft model's could keep k: it wins only when k is 1.
MIN_LOOKUP_TOKENS = 2


class HybridProposer:
    def __init__(self, draft: DraftModelProposer, lookup: PromptLookupProposer):
        """lookup: its min_ngram is the shortest match that wins a round (see MIN_NGRAM)."""
        self.draft = draft
        self.lookup = lookup
        self._last: DraftModelProposer | PromptLookupProposer | None = None  # made the last proposal
        self.rounds = {"lookup": 0, "draft": 0}  # proposals of each, this sequence
        self._guess: Draft | None = None  # this round's lookup guess, when lookup won it

    def begin(self, prompt_ids: list[int], sampling: SamplingConfig, generator: torch.Generator) -> None:
        self.draft.begin(prompt_ids, sampling, generator)
        self.lookup.begin(prompt_ids, sampling, generator)
        self._last = None
        self.rounds = {"lookup": 0, "draft": 0}

    def propose(self, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
        guess = self._pick(context, k)
        return guess if guess is not None else self.draft.propose(context, k, stop_confidence)

    def _pick(self, context: list[int], k: int) -> Draft | None:
        """Lookup's guess when it wins the round, else None (the draft model's round)."""
        # Lookup takes the full k: it costs nothing, so no confidence cut applies to it.
        self._last = self.lookup
        guess = self.lookup.propose(context, k)
        if len(guess) >= min(MIN_LOOKUP_TOKENS, k):
            self.rounds["lookup"] += 1
            return guess
        self._last = self.draft  # set before proposing: a failed propose is still observed (with 0)
        self.rounds["draft"] += 1
        return None

    def observe(self, num_accepted: int) -> None:
        if self._last is not None:
            self._last.observe(num_accepted)
        self._last = None

    # The round in steps (see DraftModelProposer.start): lookup's guess is complete at once.
    def start(self, context: list[int], k: int, stop_confidence: float = 0.0) -> None:
        self._guess = self._pick(context, k)
        if self._guess is None:
            self.draft.start(context, k, stop_confidence)

    def pending(self) -> list[int] | None:
        return None if self._guess is not None else self.draft.pending()

    @property
    def backend(self):  # where pending() tokens go
        return self.draft.backend

    def take(self, logits) -> None:
        self.draft.take(logits)

    def settle(self) -> None:
        if self._guess is None:
            self.draft.settle()

    def finish(self) -> Draft:
        return self._guess if self._guess is not None else self.draft.finish()

    def extend(self, token_ids: list[int]) -> None:
        self.draft.extend(token_ids)

    def behind(self, context: list[int]) -> int:
        return self.draft.behind(context)

    def restore(self, token_ids: list[int]) -> int:
        return self.draft.restore(token_ids)

    def remember(self) -> None:
        self.draft.remember()

    def fork(self) -> "HybridProposer":
        return HybridProposer(self.draft.fork(), self.lookup.fork())

    def release(self) -> None:
        self.draft.release()
