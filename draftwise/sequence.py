"""One sequence's whole state: its text, its slot in the target's cache, its proposer, acceptance and stats.

The engine keeps no per-sequence state of its own, so any number of sequences can be live on one engine: a
stream() generator holds one, the server's scheduler holds many and steps them together (Engine.step).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftwise.config import GenerationConfig
from draftwise.estimates import Acceptance, TreeSpread
from draftwise.grammar import Constraint
from draftwise.metrics import Stats
from draftwise.proposers.base import Proposer
from draftwise.shared_noise import SharedNoise
from draftwise.text import TextStream


@dataclass(eq=False)  # compared by identity: a sequence is a live thing, not a value
class Sequence:
    prompt_ids: list[int]
    cfg: GenerationConfig
    method: str  # the method this sequence speculates with ("none": the target alone)
    target: object  # its slot of the target's cache (a SlotView, or the backend for the engine's default slot)
    proposer: Proposer | None  # its own proposer, None for "none"
    acceptance: Acceptance | None  # None: the sequence drafts cfg.num_draft_tokens every round
    text: TextStream
    stats: Stats
    generator: torch.Generator
    spread: TreeSpread = field(default_factory=TreeSpread)  # nodes beside its drafts' deepest paths
    context: list[int] = field(default_factory=list)  # prompt + every token emitted so far
    prefilled: int = 0  # prompt tokens (of all but the last) already in the target's cache
    finish: str | None = None  # set once the sequence has ended
    error: str | None = None  # why, when it ended in an error
    exception: BaseException | None = None  # the error itself
    constraint: Constraint | None = None  # its place in the grammar its text must match (grammar.py)
    noise: SharedNoise | None = None  # a seeded sampled sequence's: its tokens are drawn from it (shared_noise.py)
    # Decoding alone (Engine.generate and stream, a server's one request in flight): its lagging draft is filled
    # before each probe (CatchUp.wants), so a plain step's token is one its draft reads later: the policy prices that
    # reading into k = 0 (adaptive.py).
    fills_before_probes: bool = False
    _prefilled_all: bool = field(default=False, repr=False)  # prefill_done, once it has been

    @property
    def draft_behind(self) -> int:
        """Tokens of the text (but its last) missing from the proposer's own cache (a draft model's); 0 without one."""
        if self.proposer is None or not self.proposer.capabilities.keeps_cache:
            return 0
        return self.proposer.behind(self.context)

    @property
    def prefill_done(self) -> bool:
        """The target holds the prompt but its last token; so does the draft of a sequence drafting a fixed k. An
        adaptive sequence's draft is filled only once speculation pays (Engine.wants_catch_up): under load it may
        never be, and its prefill would be wasted. Once done, it stays done: a round that keeps every draft token
        leaves the draft one behind (its last token is never fed), which the next round's first forward feeds, as
        the engine alone does; read again, it had a server's fixed-k request sit out every step after such a round
        while a separate forward fed that one token (a longer lag is Engine.wants_catch_up's)."""
        if not self._prefilled_all:
            self._prefilled_all = (self.prefilled >= len(self.prompt_ids) - 1
                                   and (self.acceptance is not None or not self.draft_behind))
        return self._prefilled_all

    @property
    def remaining(self) -> int:
        return self.cfg.max_new_tokens - self.stats.new_tokens
