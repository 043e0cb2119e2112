"""How many tokens each sequence of a step drafts: one draft-length policy per drafter, over one table of passes.

The target pass pads every row to the widest, so the adaptive sequences of a step share one k, the policy's choice
for that many rows; a sequence drafting a fixed k drafts its own. Each drafter (acceptance_pools.pool_method) has a
policy of its own, with its own choices, probes and draft forwards, priced over the engine's one table of target
passes (StepCosts.sharing_passes), so that what one method learnt in a server does not steer the next one's choices.
"""
from __future__ import annotations

from draftwise.acceptance_pools import drafting_acceptance, pool_method, seq_pool
from draftwise.adaptive import DraftLengthPolicy
from draftwise.sequence import Sequence

# A draft at most this many tokens behind its text catches up in its round's first draft forward; one further
# behind sits rounds out (k = 0) while it catches up in prefill-sized chunks (catch_up.py), since in a batched
# draft forward every row pays for the widest one.
MAX_DRAFT_LAG = 16


class DraftLengths:
    def __init__(self, method: str):
        self.policy = DraftLengthPolicy()  # the step's drafter's (step_policy); first, the engine's method's
        self._policies: dict[str, DraftLengthPolicy] = {pool_method(method, None): self.policy}

    def policy_for(self, pool: str) -> DraftLengthPolicy:
        """A drafter's policy, its costs a view of the one table of passes."""
        if pool not in self._policies:
            self._policies[pool] = DraftLengthPolicy(costs=self.policy.costs.sharing_passes())
        return self._policies[pool]

    def step_policy(self, seqs: list[Sequence]) -> DraftLengthPolicy:
        """The policy a step of these rows is priced and timed by: that of the drafter most of its drafting rows
        share (a mix is priced by its largest kind); with none drafting, the last step's."""
        pools = [seq_pool(seq) for seq in seqs if seq.proposer is not None]
        if not pools:
            return self.policy
        return self.policy_for(max(set(pools), key=pools.count))

    def choose(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's k, and the step's policy set to the one that priced it. Rows whose round is settled first
        (settled_rounds: prompt lookup's, and those whose draft lags) make their free guesses before it: their nodes
        widen the pass the shared k is priced by."""
        rows, depths = len(seqs), [free_depth(seq) for seq in seqs]
        for seq, depth in zip(seqs, depths):  # how deep a free guess may go, and the rows its guesses are priced in
            if seq.proposer is not None:
                seq.proposer.prepare_round(depth, rows)
        settled = settled_rounds(seqs, depths)
        everyone = [seq for seq in seqs if seq.proposer is not None and seq.acceptance and not judges_rounds(seq)]
        # Where none of them can draft (every draft lags), priced as if they could: whether drafting would pay is
        # what decides if their drafts are filled (catch_up.py); their k is 0 whatever the choice.
        adaptive = [seq for seq in everyone if seq not in settled] or everyone
        self.policy = self.step_policy(everyone or seqs)
        fixed = [seq.cfg.num_draft_tokens for seq in seqs
                 if seq.proposer is not None and not seq.acceptance and seq.draft_behind <= MAX_DRAFT_LAG]

        def priced(choice, rows_drafting: list[Sequence]) -> int:
            return choice([drafting_acceptance(seq).rate for seq in rows_drafting],
                          max(seq.cfg.num_draft_tokens for seq in rows_drafting), rows,
                          fixed, [seq.spread.side_nodes for seq in rows_drafting],
                          [seq.proposer.armed_nodes for seq in settled if seq not in rows_drafting],
                          refills=sum(refills_draft(seq) for seq in rows_drafting))

        shared = priced(self.policy.choose, adaptive) if adaptive else 0
        if len(adaptive) < len(everyone):  # whether to fill the lagging drafts: judged as if all were filled
            priced(self.policy.judge, everyone)
        ks = [0 if seq.proposer is None or seq.draft_behind > MAX_DRAFT_LAG else
              min(shared if seq.acceptance else seq.cfg.num_draft_tokens, depth)
              for seq, depth in zip(seqs, depths)]
        return [settled[seq] if seq in settled else k or free_round(seq, depth, rows)
                for seq, k, depth in zip(seqs, ks, depths)]

    def observe_costs(self, seqs: list[Sequence], drafts: list, ks: list[int], live: list[int],
                      draft_s: float, verify_s: float) -> None:
        """Fold a step's seconds into the step policy's costs: the pass is as wide as its widest live draft (a
        tree's every node), drafted in up to max(k) forwards, of rounds that ran any (a lookup guess runs none)."""
        drafting = [i for i in live if ks[i] and not _drafted_free(seqs[i])]
        steps = max((ks[i] for i in drafting), default=0)
        if len({seq_pool(seqs[i]) for i in drafting}) > 1:
            steps = 0  # drafters of different kinds drafted together: their forwards are no one's own price
        self.policy.costs.observe(len(live), max(len(drafts[i]) for i in live), draft_s, verify_s, draft_steps=steps)


def refills_draft(seq: Sequence) -> bool:
    """Whether a plain step's token is one the sequence's draft model reads later: its draft is filled before each
    probe (Sequence.fills_before_probes)."""
    return seq.fills_before_probes and seq.proposer.capabilities.keeps_cache


def settled_rounds(seqs: list[Sequence], depths: list[int]) -> dict[Sequence, int]:
    """The adaptive sequences whose round is their free guess or nothing, whatever k the others share: prompt
    lookup's methods, which judge every round (judges_rounds), and those whose draft lags more than MAX_DRAFT_LAG
    behind its text (it sits the round out, and catches up between steps, if ever). Priced among the drafting rows,
    a lagging row would count as drafting in a step where it runs plain, and drafting would be chosen in steps where
    no row could draft. Each one's k (0: a plain row; else its armed guess)."""
    return {seq: free_round(seq, depth, len(seqs)) for seq, depth in zip(seqs, depths)
            if judges_rounds(seq) or (seq.acceptance and seq.draft_behind > MAX_DRAFT_LAG)}


def free_round(seq: Sequence, k: int, rows: int) -> int:
    """k (at most the sequence's free_depth) for an adaptive sequence whose draft model sits this round out, or
    whose proposer judges every round (prompt lookup's methods): its proposer's free guess (lookup's, which needs no
    draft forward and no draft cache) where that pays alone, else 0."""
    if not (seq.acceptance and k > 0 and seq.proposer.capabilities.guesses_free):
        return 0
    return seq.proposer.free_round(seq.context, k, rows)


def judges_rounds(seq: Sequence) -> bool:
    """Whether an adaptive sequence's proposer decides each round itself, after its free guess (prompt lookup's
    methods): the shared k, priced by draft forwards and by an acceptance learnt only on drafted rounds, is not
    for it, and every round is a free round."""
    return seq.acceptance is not None and seq.proposer.capabilities.judges_rounds


def _drafted_free(seq: Sequence) -> bool:
    """Whether the sequence's proposer ran no draft forward in its last round (a lookup guess); a proposer dropped
    by the round's fallback after drafting ran its forwards."""
    return seq.proposer is not None and seq.proposer.drafted_free


def free_depth(seq: Sequence) -> int:
    """The most a sequence drafts: its num_draft_tokens, and never past the last token it may emit (wasted work)."""
    return min(seq.cfg.num_draft_tokens, seq.remaining - 1)
