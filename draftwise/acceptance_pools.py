"""Acceptance pooled across sequences: where a new adaptive sequence's estimates start.

A sequence's acceptance is learnt round by round; the next sequence of the same kind should not start from the
prior as if nothing had been seen. Each pool is keyed by the drafter (its method, on the draft it drafts with) and
by greedy or sampled (sampling keeps fewer draft tokens), and holds each estimate by name (a hybrid keeps its draft
model's and its lookup's), every leaving sequence folded in whole and decayed by sequence.
"""
from __future__ import annotations

from draftwise.estimates import DRAFT_ESTIMATE, Acceptance
from draftwise.sequence import Sequence


def pool_method(method: str, draft: str | None) -> str:
    """Whose acceptance a sequence starts from and adds to, and whose draft-length policy it follows: its method's,
    on the draft it drafts with (a draft loaded beside the engine's own keeps pools of its own: "draft@name")."""
    return method if draft is None else f"{method}@{draft}"


def seq_pool(seq: Sequence) -> str:
    return pool_method(seq.method, seq.cfg.draft)


def drafting_acceptance(seq: Sequence) -> Acceptance:
    """The acceptance the sequence's draft length follows: its proposer's own where it keeps one for the rounds
    that k prices (a hybrid's draft-model rounds), else the sequence's."""
    own = seq.proposer.drafting_acceptance
    return seq.acceptance if own is None else own


def estimates_of(seq: Sequence) -> dict[str, Acceptance]:
    """An adaptive sequence's acceptance estimates by name, what it carries to the next of its method: its
    proposer's where it keeps its own (lookup: by match length; a hybrid: its draft model's and its lookup's), else
    the sequence's."""
    if seq.proposer.capabilities.keeps_estimates:
        return seq.proposer.acceptances()
    return {DRAFT_ESTIMATE: drafting_acceptance(seq)}


class AcceptancePools:
    """(pool, greedy) -> estimate name -> the acceptance of that pool's earlier sequences."""

    def __init__(self):
        self.carried: dict[tuple[str, bool], dict[str, Acceptance]] = {}

    def start(self, seq: Sequence) -> None:
        """Start a new adaptive sequence's estimates from the rates its pool's earlier sequences kept, by name."""
        pooled = self.carried.get((seq_pool(seq), seq.cfg.sampling.greedy), {})
        rates = {name: estimate.rate for name, estimate in pooled.items()}
        if seq.proposer.capabilities.keeps_estimates:
            seq.proposer.start_acceptances(rates)
        else:
            drafting_acceptance(seq).start_from(rates.get(DRAFT_ESTIMATE))

    def carry(self, seq: Sequence) -> None:
        """Fold a leaving adaptive sequence's estimates into its pool (each that saw no round: nothing)."""
        if seq.acceptance is None:
            return
        pools = self.carried.setdefault((seq_pool(seq), seq.cfg.sampling.greedy), {})
        for name, estimate in estimates_of(seq).items():
            if estimate.observed_rate is not None:
                # From the prior, as a sequence's own estimate: a pool that has seen one probe keep its one token
                # would otherwise start every newcomer at a = 1.0 and price drafting far above what it runs at.
                pools.setdefault(name, Acceptance()).fold(estimate.kept, estimate.rejections)

    def recent(self, method: str, greedy: bool, estimate: str = DRAFT_ESTIMATE) -> float | None:
        """The per-token acceptance of the earlier adaptive sequences of this pool, over all their rounds, the
        latest weighing most; None before any drafted. Over whole sequences, since one that turned drafting off
        ended on the low rate that did it."""
        pooled = self.carried.get((method, greedy), {}).get(estimate)
        return None if pooled is None else pooled.rate
