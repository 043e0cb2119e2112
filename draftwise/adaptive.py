"""How many tokens to draft next round: the k that maximizes the batch's expected tokens per second.

Speculation pays only when the tokens a round is expected to emit outweigh what the round costs, and both
sides move with the text, the step's shape, the dtype, the machine and the load; estimates.py measures them
(Acceptance per sequence, StepCosts per drafter over the engine's passes, TreeSpread per sequence). The engine
keeps one policy per drafter (a method on its draft): what one method learnt must not steer another's choices.

Each candidate k is priced by the round planner (planner.py): the adaptive rows as chains of k at their own
rates (a tree k deep with its measured side nodes beside the path, TreeSpread), beside the rows that draft their
own k or offer a free guess; k = 0 is a plain step.
The target pass pads every row to the widest, so the batch shares one k (DraftLengthPolicy.choose): the one
whose expected tokens per second is highest. That turns speculation off when a full batch makes wide
passes dear, and back on as load falls. A plain step, which nothing narrower bounds, is timed once at each batch
size before any k is chosen over it. A wider pass never measured at a batch size costs that batch's plain step times
the width's price over a plain step at the batch sizes that measured it, interpolated by rows (without one, what the
nearest measured shape costs, interpolated between widths: optimism, so that it gets tried; past the widest
measured, on the chord from the narrowest: a pass only grows dearer a position as it widens). When k = 0 wins, a
step still drafts one token now and then (a probe), so a change is noticed: the PROBE_EVERY-th step after drafting
stopped paying, and after each probe that finds it still does not pay, twice as many steps later, up to
MAX_PROBE_GAP. A probe costs a draft forward and a wider pass for a token it rarely adds, so a
proposer that never pays (layer skipping on a small model) would otherwise lose a fixed share of every
step to them. A sequence that joins (`sequence_joined`) closes the gap again: its acceptance is only the
prior, so the gap its predecessors earned says nothing of it, and a gap wider than a request would keep
a draft that pays on it from ever being tried.
Never closer, though, than the steps over which a probe's priced loss is PROBE_BUDGET of their time: in a batch a
probe's forward and wide pass can cost nearly a step of their own, and with requests joining often, probes that
came back after every join would cost a cheap drafter a share of its throughput.
`wants_drafting` says whether drafting won without the probe, and the engine fills lagging
draft caches only when it did, and only where the tokens still to come repay the filling (`catch_up_pays`: a new
request's prompt is the draft's to read first), or, for a sequence decoding alone, before a probe (`probe_due`).
The saving a filling is weighed against is drafting's rate as priced, taken at the share of it that drafting's steps
ran (`realised`): a filling's return is a prediction for a whole answer, and prices that promise a little too much
would fill drafts whose saving never comes.
A sequence decoding alone has its draft filled before every probe, so each token it takes in a plain step is one its
draft reads later: its plain step is priced with that reading (`refilled_rate`), and near break-even it drafts on
rather than stop and pay for the reading at the next probe.

The choice never touches exactness: any k, chosen before the round from the past alone, keeps the output
the target's own (greedy) or its distribution (sampling).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from draftwise import planner
from draftwise.estimates import DECAY, STALE_STEPS, StepCosts, nearest

PROBE_EVERY = 8  # steps from drafting's last win to the first probe
MAX_PROBE_GAP = 64  # the widest the gap between probes grows
PROBE_BUDGET = 0.01  # the most of the plain steps' time between probes that a probe is priced to lose
MAX_STOP_CONFIDENCE = 0.5


@dataclass
class DraftLengthPolicy:
    """The engine's choice of one k for every adaptive sequence of a step, from their acceptance and the
    measured costs of steps of that many rows."""

    costs: StepCosts = field(default_factory=StepCosts)
    # Whether the last choice found that drafting pays (a probe aside): the engine fills lagging drafts only then.
    wants_drafting: bool = True
    # By rows: the expected tokens per second of a plain step and of the best k, at the last choice for a step of that
    # many rows: the saving a token that filling a lagging draft is weighed against (catch_up_pays).
    _priced: dict[int, tuple[float, float]] = field(default_factory=dict)
    # By rows: (tokens per second run, tokens per second priced), summed over the steps in which drafting won the
    # choice, decayed: how far the prices' promise of drafting is borne out (realised).
    _outcomes: dict[int, tuple[float, float]] = field(default_factory=dict)
    _outcome_at: dict[int, int] = field(default_factory=dict)  # by rows: the step (costs' clock) of the last outcome
    _pending: tuple[int, float] | None = None  # (rows, rate priced) of the last choice drafting won at a timed width
    _steps_without_draft: int = 0  # since drafting last won, or since the last probe
    _probe_gap: int = PROBE_EVERY
    _probe_floor: int = PROBE_EVERY  # the closest probes may come at the last choice's price (probe_floor)

    def choose(self, rates: list[float], k_max: int, rows: int, fixed: list[int] = (),
               spreads: list[float] = (), free: list[int] = (), refills: int = 0) -> int:
        """k in [0, k_max] for the sequences whose acceptance rates are `rates`, in a step of `rows` rows; the
        others (the rest of the rows) count one token each, and those drafting their own `fixed` k widen the pass.
        spreads: each adaptive sequence's nodes beside its deepest path (TreeSpread.side_nodes; none: chains).
        free: the nodes of rows whose guess is already made and ran no forward (prompt lookup's): they widen the
        pass, and add no draft forward. (Not in the gate below: a width their guesses bring is priced as any
        unmeasured one, and timed when it runs.) refills: the adaptive rows whose lagging draft is filled before
        each probe (Sequence.fills_before_probes), for whom a plain step's token is one their draft reads later."""
        if not self.costs.measured:
            return k_max  # nothing measured yet: try the full width
        if not self.costs.fresh(rows, max(fixed, default=0) + 1):
            # Unmeasured, the narrowest pass (k = 0 here; rows with their own k keep it wider) would cost what the
            # nearest measured width does, a wider one, so every k > 0 would look better than it and k = 0 would
            # never be tried: time it first. Stale, it is timed again: while drafting wins no plain step runs, so
            # a plain step first timed in a slow spell (a newcomer's prefill beside it) would price drafting's
            # rival too dear for good, and no fresher, wider pass would bound it: drafting would be chosen where it
            # loses.
            return 0
        best = self.judge(rates, k_max, rows, fixed, spreads, free, refills)
        # (An exploration, a width stale or never timed and priced as an optimist so that it gets tried, promises
        # nothing: its outcome would say how far optimism is borne out, not the prices.)
        known = best > 0 and self.costs.fresh(rows, best + 1)
        self._pending = (rows, self._priced[rows][1]) if known else None
        if best > 0:
            self._steps_without_draft, self._probe_gap = 0, PROBE_EVERY
            return best
        if not self.probe_due:
            self._steps_without_draft += 1
            return 0
        # A probe; if drafting still does not win after it, the next comes twice as many steps later.
        self._steps_without_draft, self._probe_gap = 0, min(2 * self._probe_gap, MAX_PROBE_GAP)
        return min(1, k_max)

    def judge(self, rates: list[float], k_max: int, rows: int, fixed: list[int] = (),
              spreads: list[float] = (), free: list[int] = (), refills: int = 0) -> int:
        """The best k for these rows (choose's arguments), which sets whether drafting pays (wants_drafting) and what
        it saves a token at this many rows (catch_up_pays). The engine also judges a batch whose drafts lag as if
        every one of them were filled: priced by the one row that is, drafting is a wide pass for one row's guesses
        and never pays in a batch, so no other draft would be filled and the one that was is wasted: draft after
        draft filled, and none drafting."""
        if not self.costs.measured:
            return k_max  # (nothing to price by: as choose, try the full width)
        by_k = [self.rate(rates, k, rows, fixed, spreads, free) for k in range(k_max + 1)]
        plain = by_k[0]
        by_k[0] = refilled_rate(plain, rows, refills, self.refilled_token_s())
        best = max(range(k_max + 1), key=by_k.__getitem__)
        self.wants_drafting = best > 0
        # (The plain rate without the refilling: what filling a draft saves is weighed against plain steps alone.)
        self._priced[rows] = plain, by_k[best]
        if k_max:  # (a probe drafts 1: its tokens, the adaptive rows' 1 + a and the others' 1, at either rate)
            self._probe_floor = probe_floor(rows + sum(rates), rows, plain, by_k[1])
        return best

    def refilled_token_s(self) -> float | None:
        """What a plain step's token costs a draft filled before each probe: a filling of the tokens between probes
        (one a plain step), over those tokens; None before a filling is timed."""
        gap = max(self._probe_gap, self._probe_floor)
        reading = self.costs.catch_up(gap)
        return None if reading is None else reading / gap

    def observe_outcome(self, tokens: int, seconds: float) -> None:
        """The step of the last choice emitted `tokens` in `seconds`: where drafting won that choice, how far the rate
        priced was borne out (realised)."""
        if self._pending is not None and seconds > 0:
            rows, priced = self._pending
            run, promised = (0.0, 0.0) if self._outcome_stale(rows) else self._outcomes.get(rows, (0.0, 0.0))
            self._outcomes[rows] = DECAY * run + tokens / seconds, DECAY * promised + priced
            self._outcome_at[rows] = self.costs.steps
        self._pending = None

    def _outcome_stale(self, rows: int) -> bool:
        at = self._outcome_at.get(rows)
        return at is not None and self.costs.steps - at >= STALE_STEPS

    def realised(self, rows: float) -> float:
        """The share of drafting's priced rate that its steps ran at, at the nearest rows measured: at most 1 (1 before
        any). The prices miss what they cannot see (a tree's extra nodes, a busy spell, the batch-mates' shorter
        rounds), so a saving priced from them alone is more than drafting's steps deliver, and drafts would be filled
        for a saving that does not come. An outcome not renewed in STALE_STEPS steps counts no more, as a stale
        timing (estimates.Timings), and the next one replaces it: it may date from a slow spell, and while it holds
        a lagging draft is never filled, so drafting's steps, the only ones that would renew it, never run (a
        server's lone request after a short first one never drafted)."""
        fresh = {n: outcome for n, outcome in self._outcomes.items() if not self._outcome_stale(n)}
        if not fresh:
            return 1.0
        run, promised = fresh[nearest(fresh, rows)]
        return min(1.0, run / promised)

    @property
    def probe_due(self) -> bool:
        """Whether the next choice, should drafting still not win, is a probe: a draft far behind its text must be
        filled first, or it sits the probe out (Engine.wants_catch_up) and the probe learns nothing."""
        gap = max(self._probe_gap, self._probe_floor)
        return not self.wants_drafting and self._steps_without_draft + 1 >= gap

    def saving_per_token(self, rows: float) -> float | None:
        """What drafting saves a token in steps of this many rows: at the last choice for the nearest rows priced, its
        rate taken at the share realised; None before any choice was priced."""
        if not self._priced:
            return None
        plain, best = self._priced[nearest(self._priced, rows)]
        return planner.saving_per_token(plain, best * self.realised(rows))

    def catch_up_pays(self, behind: int, tokens_to_come: float, rows: float) -> bool:
        """Whether a draft `behind` tokens behind its text is worth filling for the tokens its sequence has still to
        come in steps of `rows` rows (planner.catch_up_pays): the batch it runs in, not the step that last ran (while
        a newcomer is prefilled, the others step without it, and fewer rows save more a token). Before either side
        is measured, yes: filling one is how its cost is learnt."""
        saving = self.saving_per_token(rows)
        reading = self.costs.catch_up(behind)
        if saving is None or reading is None:
            return True
        margin = planner.CATCH_UP_MARGIN if rows > 1.5 else 1.0  # (rows: decayed, so not exactly 1 alone)
        return planner.catch_up_pays(saving, tokens_to_come, reading, margin)

    def sequence_joined(self) -> None:
        """A new adaptive sequence: the first probe comes PROBE_EVERY steps after drafting last won or probed (or as
        many as a probe's price allows, probe_floor)."""
        self._probe_gap = PROBE_EVERY

    def rate(self, rates: list[float], k: int, rows: int, fixed: list[int] = (), spreads: list[float] = (),
             free: list[int] = ()) -> float:
        """Expected tokens per second of a step in which the adaptive sequences draft k positions (a tree: k deep,
        with its spread's nodes beside the path)."""
        spreads = list(spreads) + [0.0] * (len(rates) - len(spreads))  # (none given: chains)
        offers = [planner.Offer.of_chain(a, k, spread) for a, spread in zip(rates, spreads)]
        # The others' tokens do not move with k (one each, as a plain row's); their width and forwards do count.
        offers += [planner.Offer(width=own, forwards=own) for own in fixed]
        offers += [planner.Offer(width=nodes) for nodes in free]
        return planner.rate(self.costs, rows, offers)

    def stop_confidence(self, rows: int) -> float:
        """Below this draft confidence a draft token is not worth its step: its chance of being kept (which the
        draft's own probability approximates) is smaller than what it costs, as a share of a verification pass."""
        if not self.costs.measured or not self.costs.draft(rows):
            return 0.0
        return min(MAX_STOP_CONFIDENCE, planner.break_even_chance(self.costs, rows))


def refilled_rate(plain_rate: float, rows: int, refills: int, refill_s: float | None) -> float:
    """A plain step's tokens per second where `refills` of its `rows` rows have a draft filled before each probe:
    each such row's token costs refill_s more, paid when its draft reads it. Unpriced, a sequence decoding alone
    whose acceptance is near break-even stops drafting and pays for the reading anyway, probe by probe (at a long
    context a draft reads a token for about a tenth of a plain step): slower than drafting on would have been, and
    its estimate, fed one token a probe, hardly recovers."""
    if not refills or not refill_s or plain_rate <= 0:
        return plain_rate
    return rows / (rows / plain_rate + refills * refill_s)


def probe_floor(tokens: float, rows: int, plain_rate: float, probe_rate: float) -> int:
    """The fewest steps between probes for which a probe emitting `tokens` at probe_rate (tokens/s) loses at most
    PROBE_BUDGET of the plain steps' time: what its tokens take over plain steps' (plain_rate, `rows` a step), in
    plain steps, over the budget; from PROBE_EVERY (a probe priced to pay) to MAX_PROBE_GAP."""
    lost = tokens / rows * (plain_rate / probe_rate - 1.0)  # plain steps a probe costs beyond its tokens' own
    return min(MAX_PROBE_GAP, max(PROBE_EVERY, math.ceil(lost / PROBE_BUDGET)))
