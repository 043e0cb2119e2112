"""Drafts that lag their text, and when to fill them.

An adaptive sequence's draft model is filled only once speculation pays: under load it may never be, and filling it
would be wasted. A draft at most MAX_DRAFT_LAG behind catches up in its round's first draft forward; one further
behind sits rounds out while it is filled here, in prefill-sized chunks between steps, where the tokens still to
come repay the filling.
"""
from __future__ import annotations

import time

from draftwise.acceptance_pools import seq_pool
from draftwise.draft_lengths import MAX_DRAFT_LAG, DraftLengths
from draftwise.estimates import decayed
from draftwise.fallback import Fallback
from draftwise.sequence import Sequence

# How far behind (the text's last token aside) drafting itself leaves a draft: a round that kept every guess leaves
# the last one unfed. A round's first draft forward feeds it with the text's last token.
ROUND_FEED = 1


class CatchUp:
    def __init__(self, lengths: DraftLengths, fallback: Fallback):
        self.lengths = lengths
        self.fallback = fallback
        self.open_sequences = 0  # sequences open now (rows)
        self._step_rows: float | None = None  # rows of the recent steps, decayed (rows)
        self._answer_tokens: float | None = None  # how many tokens finished answers ran, decayed (tokens_to_come)

    def observe_step(self, rows: int) -> None:
        self._step_rows = decayed(self._step_rows, rows)

    def count_answer(self, seq: Sequence) -> None:
        """Fold a finished answer's length into what tokens_to_come expects (not a failed or cancelled one's)."""
        if seq.finish in (None, "error", "cancelled"):
            return
        self._answer_tokens = decayed(self._answer_tokens, float(seq.stats.new_tokens))

    def wants(self, seq: Sequence) -> bool:
        """Whether to fill the sequence's lagging draft now: its drafter's policy chose to speculate at its last step
        and the draft is too far behind to catch up in its round, or the sequence decodes alone (fills_before_probes)
        and its next step may be a probe. A draft more than MAX_DRAFT_LAG behind would sit the probe out (as the gap between probes doubles
        past it, every later probe of a long request would learn nothing); a nearer one would catch up in the
        probe's first draft forward, which is timed as drafting: the probe would price the draft's forward well
        above what it costs, and keep drafting off for the rest of the request. So before a probe the draft is
        filled to the text (less the tokens a round's first forward feeds anyway). In a batch, a probe is not worth
        every row's catch-up. A sequence drafting a fixed k always drafts, and its rounds must not follow the
        engine's state (it asked for k every round): its draft is filled whenever it is too far behind
        (a hybrid's lookup rounds leave it behind), whatever the policy last chose. Else a draft is filled only
        where the tokens still to come repay the filling (DraftLengthPolicy.catch_up_pays): in a batch, where
        drafting saves little a token, a short answer to a long prompt is cheaper without its draft."""
        if seq.acceptance is None:
            return seq.proposer is not None and seq.draft_behind > MAX_DRAFT_LAG
        policy = self.lengths.policy_for(seq_pool(seq))
        if seq.fills_before_probes and policy.probe_due:
            return seq.draft_behind > ROUND_FEED
        return (policy.wants_drafting and seq.draft_behind > MAX_DRAFT_LAG
                and policy.catch_up_pays(seq.draft_behind, self.tokens_to_come(seq), self.rows))

    @property
    def rows(self) -> float:
        """The batch a lagging draft would draft in, which its filling is priced at: the sequences open now, or the
        recent steps' rows where those were more. Between one request's end and the next one's arrival a server at
        2 requests has 1 open, where drafting saves far more a token than at 2; priced there, every draft would be
        filled in that gap and never used."""
        return max(self.open_sequences, self._step_rows or 0.0)

    def tokens_to_come(self, seq: Sequence) -> float:
        """What a sequence has still to emit, as far as can be told: the rest of its limit, but no more than the
        engine's finished answers ran (a chat without max_tokens may run to the end of the context; few do), or than
        it has run already where it has outlived them."""
        if self._answer_tokens is None:
            return seq.remaining
        return min(seq.remaining, max(self._answer_tokens, seq.stats.new_tokens))

    def fill(self, seq: Sequence, max_tokens: int | None = None) -> None:
        """Feed (up to max_tokens of) the text the sequence's draft cache lacks, all but the last token."""
        behind = seq.draft_behind
        if not behind:
            return
        start = len(seq.context) - 1 - behind
        tokens = seq.context[start: start + min(behind, max_tokens or behind)]
        started = time.perf_counter()
        try:
            seq.proposer.extend(tokens)
        except Exception as err:  # a failing draft is the proposer's fault: with fallback on, the target goes on
            if not self.fallback.on_proposer_error:
                raise
            self.fallback.drop(seq, err)
        else:  # (what reading costs a token, which catch_up_pays weighs)
            self.lengths.policy_for(seq_pool(seq)).costs.observe_catch_up(len(tokens), time.perf_counter() - started)

    def timed_fill(self, seq: Sequence) -> float:
        """fill(seq); the seconds it took."""
        started = time.perf_counter()
        self.fill(seq)
        return time.perf_counter() - started
