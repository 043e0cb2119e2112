"""The speculative round for a batch of sequences: propose -> verify -> commit -> emit, caches rewound in `finally`.

propose: each sequence drafts (up to) its k tokens, draft-model sequences sharing each draft forward. verify: every
sequence's [last token, draft...] in one batched target pass, each row's verdict the verifier's (exact). commit:
whatever happened, each sequence's caches hold exactly its accepted text. emit: each text grows by its kept draft
tokens and the target's own next token, and the policy learns what the step cost.

Cache rule: a sequence's target slot holds every token of its text except the last one, which is fed at the head
of the next round, so row 0 of a round's logits scores the first draft token.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftwise.draft_lengths import DraftLengths
from draftwise.errors import DraftwiseError
from draftwise.fallback import Fallback
from draftwise.proposers.base import Proposer
from draftwise.proposers.batch import propose_many
from draftwise.sequence import Sequence
from draftwise.types import Draft, Event, Verdict
from draftwise.verify.batch import DraftBatch, verify_batch


@dataclass
class StepTimes:
    """Where one step's seconds went, for the server's metrics."""

    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0


@dataclass
class RoundHooks:
    """What the server watches. round_observer: called with (seq, draft, verdict, step times) after each verified
    round, before its tokens join the text (so len(seq.context) is where the draft starts): the proposal log.
    feature_sink: called with (seq, start, features [n, H]) as the target's last hidden states at positions start ..
    start + n - 1 of a sequence's text are computed (its prompt's at prefill, its kept positions at each
    verification): the feature capture. Set, every pass returns them."""

    round_observer: Callable[[Sequence, Draft, Verdict, StepTimes], None] | None = None
    feature_sink: Callable[[Sequence, int, torch.Tensor], None] | None = None


@dataclass
class Verified:
    """A pass's outcome: each live row's verdict and features, and whether the pass ran as one shaped step."""

    verdicts: dict[int, Verdict] = field(default_factory=dict)
    features: dict[int, torch.Tensor] = field(default_factory=dict)
    timed: bool = True  # (a pass run again row by row is not the shape the step costs price)


@dataclass
class Round:
    target: object  # the shared target backend
    max_context: int
    eos: frozenset[int]
    lengths: DraftLengths
    fallback: Fallback
    hooks: RoundHooks
    last_step: StepTimes = field(default_factory=StepTimes)

    def step(self, seqs: list[Sequence]) -> dict[Sequence, list[Event]]:
        """One round for every sequence (each prefilled, none finished). Returns each sequence's events; a sequence
        that ended gets its final event, and one whose round failed ends with finish "error" (seq.exception holds
        why) while the others go on."""
        started = time.perf_counter()
        ks = self.lengths.choose(seqs)  # how much each drafts: what the measured costs and acceptance say pays
        chosen = time.perf_counter()
        drafts = self.propose(seqs, ks)  # propose: each sequence's Draft, or the exception that ended its round
        proposed = time.perf_counter()
        too_slow = self.fallback.where_drafting_failed(seqs, drafts, ks, proposed - chosen)
        live = [i for i, d in enumerate(drafts) if not isinstance(d, BaseException)]
        verified = Verified()
        try:  # verify: every live draft in one target pass
            verified = self.verify_rows(seqs, drafts, live)
        finally:  # commit: whatever happened, each sequence's caches hold exactly its accepted text
            verified_at = time.perf_counter()
            failed = self.commit(seqs, ks, drafts, verified)
            self.fallback.drop_slow(too_slow, proposed - chosen)  # (their drafts were good, and are used)
        times = StepTimes(proposed - chosen, verified_at - proposed)  # (the choice is the step's overhead, below)
        verdicts = verified.verdicts
        if verdicts and verified.timed:  # adapt: what this shape of step cost, which prices the next rounds' lengths
            self.lengths.observe_costs(seqs, drafts, ks, live, times.draft_s, times.verify_s)
        for i, err in failed.items():  # (after the costs: the pass itself ran for them)
            drafts[i] = err
            verdicts.pop(i, None)
        # emit: each text grows by its kept draft tokens and the target's own next token (and acceptance learns)
        events = {seq: self.emit_alone(seq, drafts[i], verdicts.get(i), ks[i], times) for i, seq in enumerate(seqs)}
        times.total_s = time.perf_counter() - started
        if verdicts and verified.timed:
            self._observe_step(verdicts, drafts, events, times)
        for seq in seqs:
            seq.stats.decode_s += times.total_s
        self.last_step = times
        return events

    def _observe_step(self, verdicts: dict[int, Verdict], drafts: list, events: dict, times: StepTimes) -> None:
        """What the step cost beside drafting and its pass, which every step pays; and what the choice's price
        promised, run."""
        policy = self.lengths.policy
        drafted = any(len(drafts[i]) for i in verdicts)
        policy.costs.observe_overhead(len(verdicts), drafted, times.total_s - times.draft_s - times.verify_s)
        emitted = sum(event.token_id is not None for row in events.values() for event in row)
        policy.observe_outcome(emitted, times.total_s)

    # -- propose -------------------------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft | BaseException]:
        """Each sequence's draft of (up to) its k tokens; a proposer's error is its sequence's result, not the
        step's. A grammar shapes each draft to what it allows (and drafts the tokens it forces)."""
        stop = self.lengths.policy.stop_confidence(len(seqs))
        stops = [stop if seq.acceptance else 0.0 for seq in seqs]
        drafts = propose_many([seq.proposer for seq in seqs], [seq.context for seq in seqs], ks, stops)
        for i, seq in enumerate(seqs):  # a tree may be wider than k: the pass writes a position per node
            if isinstance(drafts[i], Draft):
                drafts[i] = drafts[i].prefix(self.max_context - len(seq.context))
                if seq.constraint is not None and seq.proposer is not None:  # (`none` steps alone)
                    room = min(seq.remaining - 1, self.max_context - len(seq.context))
                    try:
                        drafts[i] = seq.constraint.shape(drafts[i], room)
                    except DraftwiseError as err:  # (a grammar that cannot go on ends its own sequence)
                        drafts[i] = err
        return drafts

    # -- verify --------------------------------------------------------------------------------------------------
    def verify_rows(self, seqs: list[Sequence], drafts: list, live: list[int]) -> Verified:
        """Every live draft in one target pass; if that pass fails, each row once more alone."""
        try:
            return Verified(*self.verify(seqs, drafts, live))
        except Exception as err:
            return Verified(*self.verify_alone(seqs, drafts, live, err), timed=False)

    def verify(self, seqs: list[Sequence], drafts: list,
               live: list[int]) -> tuple[dict[int, Verdict], dict[int, torch.Tensor]]:
        """Each live sequence's verdict, and for those whose proposer reads the target's features (every one, with a
        feature_sink), the pass's features of its row ([n_i, H])."""
        if not live:
            return {}, {}
        rows = [(seqs[i].target, [seqs[i].context[-1], *drafts[i].token_ids]) for i in live]
        trees = [drafts[i].layout for i in live]
        hidden = self.hooks.feature_sink is not None or any(reads_features(seqs[i].proposer) for i in live)
        out = self.target.forward_batch(rows, trees=trees, hidden=hidden)
        per_row, features = out if hidden else (out, [])
        # A grammar's mask on p at every position the row scores: the verdict is then the constrained target's.
        per_row = [row if seqs[i].constraint is None else seqs[i].constraint.mask(row, drafts[i])
                   for i, row in zip(live, per_row)]
        batch = DraftBatch.of([drafts[i] for i in live])
        logits = per_row[0] if len(per_row) == 1 else torch.cat(per_row)  # [T + B, vocab] (one row: no copy)
        drawn = [None if seqs[i].noise is None else seqs[i].noise.draws(row, row_positions(seqs[i], drafts[i]))
                 for i, row in zip(live, per_row)]
        found = verify_batch(batch, logits, [seqs[i].cfg.sampling for i in live], [seqs[i].generator for i in live],
                             drawn)
        return dict(zip(live, found)), dict(zip(live, features))

    def verify_alone(self, seqs: list[Sequence], drafts: list, live: list[int],
                     shared_error: Exception) -> tuple[dict[int, Verdict], dict[int, torch.Tensor]]:
        """The shared target pass failed: each of its rows once more on its own, so that what one sequence alone
        brings (a prompt or draft the model cannot take) ends its own round, not every request in the batch. A row
        that fails alone gets its own error in place of its draft; a single row's shared error is its own. (A seeded
        row draws from its noise, which no failed pass moved: its text is what it would have been.)"""
        if len(live) == 1:
            drafts[live[0]] = shared_error
            return {}, {}
        verdicts, features = {}, {}
        for i in live:
            seqs[i].target.trim(len(seqs[i].context) - 1)  # the shared pass may have written its row: the text only
            try:
                verdict, feature = self.verify(seqs, drafts, [i])
            except Exception as own:
                drafts[i] = own
                continue
            verdicts.update(verdict)
            features.update(feature)
        return verdicts, features

    # -- commit --------------------------------------------------------------------------------------------------
    def commit(self, seqs: list[Sequence], ks: list[int], drafts: list, verified: Verified) -> dict[int, Exception]:
        """Every sequence's caches to its accepted text; returns the sequences whose caches failed to commit it
        (each ends with its error, its target holding the text)."""
        failed = {}
        for i, seq in enumerate(seqs):
            try:
                commit_caches(seq, ks[i], drafts[i], verified.verdicts.get(i), verified.features.get(i),
                              self.hooks.feature_sink)
            except Exception as err:  # this sequence's alone
                seq.target.trim(len(seq.context) - 1)
                failed[i] = err
        return failed

    # -- emit ----------------------------------------------------------------------------------------------------
    def emit_alone(self, seq: Sequence, draft, verdict: Verdict | None, k: int, times: StepTimes) -> list[Event]:
        """emit, where what fails ends this sequence alone (with its error), not the batch's step."""
        try:
            return self.emit(seq, draft, verdict, k, times)
        except Exception as err:
            return self.emit(seq, err, None, k, times)

    def emit(self, seq: Sequence, draft, verdict: Verdict | None, k: int, times: StepTimes) -> list[Event]:
        if verdict is None:  # the round failed: the sequence ends here, its caches already consistent
            seq.finish, seq.exception = "error", draft
            seq.error = f"{type(draft).__name__}: {draft}"
            return [Event(token_id=None, text="", finish_reason="error", stats=seq.stats, error=seq.error)]
        seq.stats.draft_s += times.draft_s
        seq.stats.verify_s += times.verify_s
        draft, verdict, forced = proposers_part(draft, verdict)  # (a grammar's forced tail apart)
        self._observe_round(seq, draft, verdict, times)
        events = []
        for i, token in enumerate([*draft.accepted(verdict), *forced, verdict.next_token]):
            seq.context.append(token)
            seq.stats.new_tokens += 1
            piece = seq.text.add(token)
            seq.finish = self.finish_reason(token, seq)
            if seq.finish is not None:
                piece += seq.text.finish()
            events.append(Event(token_id=token, text=piece, from_draft=i < verdict.num_accepted + len(forced)))
            if seq.finish is not None:
                break
        if seq.constraint is not None:
            seq.constraint.advance([event.token_id for event in events])
        # Draft tokens cut off by an end (EOS, stop, length) were never kept.
        seq.stats.observe_draft(draft.depth, min(verdict.num_accepted, len(events)), nodes=len(draft))
        seq.stats.forced_tokens += max(0, min(len(forced), len(events) - verdict.num_accepted))
        if seq.finish is not None:
            events.append(Event(token_id=None, text="", finish_reason=seq.finish, stats=seq.stats))
        return events

    def _observe_round(self, seq: Sequence, draft: Draft, verdict: Verdict, times: StepTimes) -> None:
        """The round's record for the server, and what the sequence's acceptance learns from it."""
        if self.hooks.round_observer is not None and draft.token_ids:
            try:
                self.hooks.round_observer(seq, draft, verdict, times)
            except Exception:  # a record of the round is never worth the request
                pass
        if seq.acceptance:
            seq.acceptance.observe(draft.depth, verdict.num_accepted)
            if not seq.proposer.drafted_free:  # a lookup guess is not what the shared k prices
                seq.spread.observe(len(draft), draft.depth)

    def finish_reason(self, token: int, seq: Sequence) -> str | None:
        if seq.text.stopped:
            return "stop"
        if token in self.eos and not seq.cfg.ignore_eos:
            return "eos"
        if seq.stats.new_tokens >= seq.cfg.max_new_tokens:
            return "length"
        return None


def commit_caches(seq: Sequence, k: int, draft, verdict: Verdict | None, features: torch.Tensor | None = None,
                  sink=None) -> None:
    """Both caches hold exactly the accepted text, even when the round failed. A proposer that reads the target's
    features gets those of the kept positions (the text's last token and the accepted drafts), and so does the
    feature sink. The proposer hears of its own tokens only: what a grammar forced after them is text it catches
    up on."""
    base = len(seq.context) - 1
    kept = verdict.num_accepted if verdict else 0
    path = list(range(kept)) if verdict is None or verdict.path is None else list(verdict.path)
    if path != list(range(kept)):
        seq.target.keep(base + 1, [base + 1 + node for node in path])  # a tree's path, into place
    seq.target.trim(base + 1 + kept if verdict else base)
    reads = reads_features(seq.proposer)
    if verdict is not None and features is not None and (reads or sink is not None):
        kept_features = features[[0, *(1 + node for node in path)]]  # [kept + 1, H]
        if reads:
            seq.proposer.add_features(base, kept_features)
        if sink is not None:
            sink(seq, base, kept_features)
    if k > 0:
        own = draft.own if isinstance(draft, Draft) else kept
        if verdict is not None:  # (a tree drafted in the proposer's own cache keeps its path there)
            seq.proposer.keep_path(path[:own])
        seq.proposer.observe(min(kept, own))


def proposers_part(draft: Draft, verdict: Verdict) -> tuple[Draft, Verdict, list[int]]:
    """A round's draft and verdict as the proposer made and earned them, and the kept tokens that a grammar forced
    after its guesses (grammar.py: Constraint.shape); these only join the text (after the proposer's kept ones)."""
    if not draft.forced:
        return draft, verdict, []
    own = draft.own
    if verdict.num_accepted <= own:
        return draft.prefix(own), verdict, []
    forced = list(draft.token_ids[own: verdict.num_accepted])
    return draft.prefix(own), Verdict(own, verdict.next_token, verdict.path), forced


def row_positions(seq: Sequence, draft: Draft) -> list[int]:
    """The text position each row of a sequence's pass scores the token of: row 0 (its last token) the next one, a
    chain's row i the i-th after it, a tree's row that of its node's depth."""
    base = len(seq.context)
    depths = range(len(draft) + 1) if draft.layout is None else draft.layout.depth
    return [base + depth for depth in depths]


def reads_features(proposer: Proposer | None) -> bool:
    """Whether a proposer drafts from the target's hidden states (the feature head), handed over by the round."""
    return proposer is not None and proposer.capabilities.reads_target_features
