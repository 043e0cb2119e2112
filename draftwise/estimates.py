"""What the engine measures as it runs, for the draft length (adaptive.py) and the proposers that size their
own guesses (prompt lookup, the hybrids, token trees).

Speculation pays only when the tokens a round is expected to emit outweigh what the round costs, and both
sides move: acceptance changes with the text (a copied span, then free prose), and the cost of a step
depends on its shape, the dtype and the machine (in float32 on CPU, verifying 5 tokens costs about two plain
steps; in bfloat16 about one), and on how many sequences share it: one row of a batch is nearly free while
decoding is memory-bound, but every draft token adds a token per row to a pass that turns compute-bound.
So both are measured as the engine runs:

- acceptance `a`, per sequence (Acceptance): the maximum-likelihood per-token rate of a geometric run (kept
  tokens over kept tokens plus rejections), decayed so that recent rounds count most, and starting from what
  earlier sequences of the same method kept in this engine where that is above the estimate's own prior
  (Acceptance.start_from; a hybrid's lookup carries its own, by match length), so that one bad first round does
  not turn drafting off;
- the step's costs (StepCosts), by the number of rows in the step: seconds per verification pass of each width
  n = k + 1, one table per engine; per drafter (a method on its draft), seconds per draft forward, decayed the
  same way, and the seconds a lagging draft takes to read a token of its text (a new request's prompt). A timing
  not renewed in STALE_STEPS steps is stale (Timings): priced at most as the fresh ones imply, and replaced, not
  averaged, when next timed;
- the nodes a tree offers beside its deepest path, per sequence (TreeSpread).

They sit below the proposers and the engine (the layers of docs/architecture.md): a proposer reads them, and never the
policy that chooses k.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

DECAY = 0.9  # weight of the past in every running estimate, per round
# A timing not renewed in this many steps is stale (Timings): it may date from a slow spell, and a shape that looks
# dear is not chosen, so it would never be timed again.
STALE_STEPS = 64
# A stale timing that its next timing confirms (CONFIRMED of it, or dearer) stays fresh twice as long, up to this
# many steps: a shape that looks cheap only once stale (a wide pass priced as the fresh narrow ones imply) would
# otherwise be run again every STALE_STEPS steps at what it was known to cost, for each stale width; where a wide
# pass costs several plain steps, those retries alone take a noticeable share of a batch's time
# (docs/experiments/constants/README.md).
MAX_STALE_STEPS = 16 * STALE_STEPS
CONFIRMED = 0.9
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0  # a = 0.5 before any evidence, worth two tokens of it
CARRIED_TRIALS = 4.0  # a prior carried from earlier sequences (Acceptance.start_from) is worth four tokens
DRAFT_ESTIMATE = "draft"  # the name of a sequence's drafting acceptance among those an engine carries


def interpolate(table: dict[int, float], n: float) -> float:
    """table[n] if measured, else linear between the nearest measured widths, else the nearest one's value."""
    if n in table:
        return table[n]
    below = max((w for w in table if w < n), default=None)
    above = min((w for w in table if w > n), default=None)
    if below is None or above is None:
        return table[below if above is None else above]
    share = (n - below) / (above - below)
    return (1 - share) * table[below] + share * table[above]


def widen(table: dict[int, float], n: float) -> float:
    """A pass of width n from the widths measured at one batch size: interpolate()'s within and below them; past the
    widest, on the chord from the narrowest to the widest, never below the widest. A pass's cost rises at least
    that fast past its measured widths (the wider it is, the more it is compute-bound), so a width far past them,
    priced as the widest, would be chosen at a fraction of its cost: a large tree grown on the price of a narrow
    pass ran several times slower than it was priced (docs/experiments/throttle-zen4, section 13)."""
    widest = max(table)
    if n <= widest or len(table) == 1:
        return interpolate(table, n)
    narrowest = min(table)
    slope = max(0.0, (table[widest] - table[narrowest]) / (widest - narrowest))
    return table[widest] + slope * (n - widest)


def along(table: dict[int, float], n: float) -> float:
    """table[n] if measured, else on the line through the measured points: between the nearest two, or past the
    ends on the nearest two's slope (bounded below: no less than the last point past it, no less than the first
    point's share per unit before it); one point: in proportion to it."""
    if n in table:
        return table[n]
    if len(table) == 1:
        (m, value), = table.items()
        return value * n / m
    points = sorted(table)
    if points[0] < n < points[-1]:
        return interpolate(table, n)
    if n > points[-1]:  # more than timed: on at the last two's slope, never below the last
        a, b = points[-2:]
        return max(table[b] + (table[b] - table[a]) / (b - a) * (n - b), table[b])
    a, b = points[:2]  # fewer than timed: back at the first two's slope, never below the first's share
    return max(table[a] + (table[b] - table[a]) / (b - a) * (n - a), table[a] * n / a)


def nearest(keys, n: int) -> int:
    """The measured batch size closest to n (the smaller one on a tie: it costs less, so it is the optimist)."""
    return min(keys, key=lambda m: (abs(m - n), m))


@dataclass
class Acceptance:
    """One sequence's per-token acceptance rate."""

    _accepted: float = PRIOR_ACCEPTED
    _trials: float = PRIOR_TRIALS
    kept: int = 0  # draft tokens kept since the start, undecayed and without the prior: what start_from carries
    rejections: int = 0  # rounds since the start that rejected a draft token

    def start_from(self, rate: float | None) -> None:
        """Start a fresh estimate from a prior: `rate`, what earlier sequences of this kind kept, worth CARRIED_TRIALS
        tokens, where it is above the prior the estimate was made with (the default, 0.5 worth two tokens, or a
        pessimistic one lookup starts from after a short match); else that prior. Why: under the default one first
        round that keeps nothing drops a to 0.32, below break-even for a small draft model on a CPU, and drafting
        stays off until a probe 8 steps on (16 if that fails too): whether a request drafts at all would hang on its
        first round's luck. A prior near what the draft usually does,
        worth a little more, lets one bad round pass; two in a row still turn drafting off. Never below the made-with
        prior, though: a start below it turns drafting off before the sequence's own text is tried, and what the draft
        did on other texts says little of this one (a short warm-up can end far below what the requests after it
        keep)."""
        assert not (self.kept or self.rejections), "start_from starts a fresh estimate"
        if rate is not None and rate > self.rate:
            self._accepted, self._trials = rate * CARRIED_TRIALS, CARRIED_TRIALS

    @property
    def observed_rate(self) -> float | None:
        """The rate of this sequence's rounds alone, undecayed (None before any): what it carries to the next."""
        trials = self.kept + self.rejections
        return self.kept / trials if trials else None

    @property
    def rate(self) -> float:
        return self._accepted / self._trials

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """One round: num_draft offered, the first num_accepted kept."""
        if num_draft > 0:
            rejected = 1 if num_accepted < num_draft else 0
            self.kept, self.rejections = self.kept + num_accepted, self.rejections + rejected
            self.fold(num_accepted, rejected)

    def fold(self, kept: float, rejections: float) -> None:
        """New evidence into the decayed estimate: what came before weighs DECAY, the new counts whole. A round's
        (observe), or a whole sequence's in the engine's pool of earlier sequences (Engine.recent_acceptance)."""
        self._accepted = DECAY * self._accepted + kept
        self._trials = DECAY * self._trials + kept + rejections


class Timings:
    """Seconds by shape (a pass's width, a batch's rows, a draft forward's nodes), decayed, each with the step it was
    last timed at. A timing not renewed in STALE_STEPS steps is stale: it may date from a slow spell (a process
    sharing the cores, an engine's first requests while the machine was busy), and a shape that looks dear is not
    chosen, so it would never be timed again: an engine whose first requests shared the CPU with a busy process
    would keep pricing the widths it stopped running at what that spell cost, and never offer them again. So a
    stale timing is priced at most as the fresh ones imply (`extend`), and its next timing replaces it instead of
    being averaged with it. A pass's width extends by widen: interpolated, past the widest on their chord, and with
    one fresh width as that one (optimism, as for a shape never timed: one too cheap is chosen, and timed, at once).
    On the chord, not as the widest fresh: a draft tree whose wide passes had all gone stale, priced as its plain
    step, grew wide and ran far slower than priced; once that width is fresh again, the other stale ones are priced
    through it, not each tried so in turn. A round's draft forwards extend by along: with one fresh count, in
    proportion to it (a round of several forwards whose timing went stale while probes timed rounds of one, priced
    as one, was chosen at a fraction of what its forwards took). Both: docs/experiments/throttle-zen4, section 13.
    A re-timing that confirms the old one (not a slow spell's, then) doubles how long the shape stays fresh
    (MAX_STALE_STEPS at most): each retry of a shape known dear costs what it was known to."""

    def __init__(self, extend: Callable[[dict[int, float], float], float] = widen):
        self.extend = extend  # how the fresh timings price a shape they do not hold
        self.seconds: dict[int, float] = {}
        self._timed_at: dict[int, int] = {}
        self._fresh_for: dict[int, int] = {}  # steps a shape's timing stays fresh: STALE_STEPS, or more once confirmed
        # priced() as of one step: the cost model reads a table dozens of times a round (each k, each tree size),
        # and it changes only with the clock or a timing.
        self._priced: tuple[int, dict[int, float]] | None = None
        self._fresh: tuple[int, dict[int, float]] | None = None

    def observe(self, shape: int, seconds: float, now: int) -> None:
        if self.stale(shape, now):
            confirmed = seconds >= CONFIRMED * self.seconds.pop(shape)
            fresh_for = self._fresh_for.get(shape, STALE_STEPS)
            self._fresh_for[shape] = min(2 * fresh_for, MAX_STALE_STEPS) if confirmed else STALE_STEPS
        decay_into(self.seconds, shape, seconds)
        self._timed_at[shape] = now
        self._priced = self._fresh = None

    def stale(self, shape: int, now: int) -> bool:
        """Whether this shape was timed, but not in the STALE_STEPS steps before `now` (more, once confirmed)."""
        at = self._timed_at.get(shape)
        return at is not None and now - at >= self._fresh_for.get(shape, STALE_STEPS)

    def fresh(self, now: int) -> dict[int, float]:
        """Seconds by shape, of the shapes not stale at step `now` (as of one step, as priced)."""
        if self._fresh is None or self._fresh[0] != now:
            self._fresh = now, {shape: s for shape, s in self.seconds.items() if not self.stale(shape, now)}
        return self._fresh[1]

    def priced(self, now: int) -> dict[int, float]:
        """Seconds by shape as priced at step `now`: fresh ones as timed, stale ones at most as the fresh imply."""
        if self._priced is None or self._priced[0] != now:
            self._priced = now, self._price(now)
        return self._priced[1]

    def _price(self, now: int) -> dict[int, float]:
        fresh = self.fresh(now)
        if not fresh or len(fresh) == len(self.seconds):
            return self.seconds
        return {shape: s if shape in fresh else min(s, self.extend(fresh, shape)) for shape, s in self.seconds.items()}


@dataclass
class StepCosts:
    """Seconds of a step's parts, by the number of rows (sequences) in it.

    The target's passes cost what they cost whoever drafted them, but a draft forward is its proposer's own: the
    0.5B draft's chain forward, a tree's level of nodes, a skipping target's layers. So each kind of proposer
    prices with a view of its own (sharing_passes): the one table of passes and the one clock, its own draft
    forwards, overheads and catch-up. One table for all let a server's previous method price the next one's
    drafting (a draft tree's wide forwards priced `hybrid`'s chain ones, which it then never ran to renew)."""

    _verify_s: dict[int, Timings] = field(default_factory=dict)  # rows -> seconds per pass by width n
    # rows -> seconds of a round's drafting by its draft forwards. By forwards, not per forward: a round's first
    # forward reads what the last round kept beside its own token (up to k + 1 positions) and the later ones one
    # each, so a forward's average falls with k, and a price per forward learnt from short rounds overcharges long
    # ones (adaptive k chose short rounds where long ones ran faster: docs/experiments/throttle-zen4, section 7).
    _draft_s: dict[int, Timings] = field(default_factory=dict)
    # (rows, whether the step drafted) -> seconds a step spends outside drafting and its pass (choosing, committing,
    # accepting), decayed: a step costs it whatever it drafts, so fewer, longer rounds save it.
    _overhead_s: dict[tuple[int, bool], float] = field(default_factory=dict)
    _clock: list[int] = field(default_factory=lambda: [0])  # [steps timed]: shared by the views (sharing_passes)
    # (steps, rows -> _positions' tables) as of one step
    _positions_at: tuple[int, dict] = field(default_factory=lambda: (-1, {}))
    # (seconds, tokens, fillings) of the lagging drafts' fillings, each sum decayed a filling (catch_up)
    _catch_up: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def steps(self) -> int:
        """Steps timed (by this view or another sharing its passes): the clock that stale timings are judged by."""
        return self._clock[0]

    def sharing_passes(self) -> "StepCosts":
        """Another proposer's costs: the same passes and clock, draft forwards, overheads and catch-up of its own."""
        return StepCosts(_verify_s=self._verify_s, _clock=self._clock)

    @property
    def measured(self) -> bool:
        return bool(self._verify_s)

    def knows(self, rows: int, n: int) -> bool:
        """Whether a pass of this many rows and this width has been timed."""
        return rows in self._verify_s and n in self._verify_s[rows].seconds

    def fresh(self, rows: int, n: int) -> bool:
        """Whether a pass of this many rows and this width has been timed and is not stale (Timings.stale)."""
        return self.knows(rows, n) and not self._verify_s[rows].stale(n, self.steps)

    def verify(self, rows: int, n: int) -> float:
        timings = self._verify_s[nearest(self._verify_s, rows)]
        near = timings.fresh(self.steps)
        if n in near:
            return near[n]
        # Unmeasured, or stale (priced at most as the fresh imply, Timings): from the fresh timings.
        estimate = self._unmeasured(rows, n, timings.priced(self.steps))
        return min(timings.seconds[n], estimate) if n in timings.seconds else estimate

    def _unmeasured(self, rows: int, n: int, near: dict[int, float]) -> float:
        # An unmeasured width at a batch size whose plain step is known: that step times what the width costs
        # over a plain step at the batch sizes that measured both (_width_ratio), so that a batch size only just
        # reached (a row joined) inherits its neighbours' verdict on drafting instead of finding every width free.
        shaped = [r for r, widths in self._verify_s.items() if 1 in widths.seconds and len(widths.seconds) > 1]
        if 1 in near and shaped:
            estimate = near[1] * self._width_ratio(shaped, rows, n)
        else:
            estimate = widen(near, n)
        # No less than a pass of as many positions has cost: a width's ratio learnt at 1 row (nearly flat while
        # decoding is memory-bound) says nothing of 8 rows, where the pass has turned compute-bound, and a batch
        # size that never drafted would price every width at its plain step. Priced so, a large batch found drafting
        # far faster than a plain step where its wide pass cost well over one, filled lagging drafts for it, and lost
        # to off without drafting a round that paid (docs/experiments/throttle-zen4, section 9).
        return max(estimate, self._by_positions(rows, n))

    def _width_ratio(self, shaped: list[int], rows: int, n: int) -> float:
        """What a pass n wide costs over a plain step at this many rows, from the batch sizes that measured both
        (shaped): between the nearest below and above, interpolated by rows; else the nearest one's. A width's price
        over a plain step rises with the rows (decoding turns from memory-bound to compute-bound), so the smaller
        neighbour's ratio alone priced a pass below what it ran, and drafted at a loss (the figures:
        docs/experiments/constants/README.md; docs/experiments/throttle-zen4, section 13)."""
        def ratio(at: int) -> float:
            widths = self._widths(at)
            return widen(widths, n) / widths[1]

        below = max((r for r in shaped if r <= rows), default=None)
        above = min((r for r in shaped if r >= rows), default=None)
        if below is None or above is None or below == above:
            return ratio(nearest(shaped, rows))
        share = (rows - below) / (above - below)
        return (1 - share) * ratio(below) + share * ratio(above)

    def _by_positions(self, rows: int, n: int) -> float:
        """What a pass of rows x n positions costs, from the fresh passes of no more rows by their positions (the
        cheapest shape of each count): between the fewest and the most, interpolated; past the most, on the slope of
        plain steps by rows (what a position costs once the batch is compute-bound; a width's own slope, timed at one
        or two widths, is too short a line to follow). 0.0 before any pass is timed. Of no more rows: as many
        positions in more rows cost no less (each row its own cache to attend over), so those bound it from below,
        where a pass of more rows would overprice a wide one of few. Fresh ones only: a stale shape is priced as the
        fresh imply (Timings), which this is part of."""
        table, plain = self._positions(rows)
        if not table:
            return 0.0
        positions, most = rows * n, max(table)
        if positions <= most:
            return interpolate(table, positions)
        if len(plain) < 2:
            return table[most]
        fewest, widest = min(plain), max(plain)
        slope = max(0.0, (plain[widest] - plain[fewest]) / (widest - fewest))
        return table[most] + slope * (positions - most)

    def _positions(self, rows: int) -> tuple[dict[int, float], dict[int, float]]:
        """_by_positions' tables for passes of no more than `rows` rows: seconds by positions, and plain steps' by rows
        (as of one step: the cost model prices dozens of shapes a round)."""
        if self._positions_at[0] != self.steps:
            self._positions_at = self.steps, {}
        if rows not in self._positions_at[1]:
            table: dict[int, float] = {}
            plain: dict[int, float] = {}
            for fewer in (r for r in self._verify_s if r <= rows):
                fresh = self._verify_s[fewer].fresh(self.steps)
                for width, seconds in fresh.items():
                    table[fewer * width] = min(seconds, table.get(fewer * width, seconds))
                if 1 in fresh:
                    plain[fewer] = fresh[1]
            self._positions_at[1][rows] = table, plain
        return self._positions_at[1][rows]

    def _widths(self, rows: int) -> dict[int, float]:
        return self._verify_s[rows].priced(self.steps)

    def draft_round(self, rows: int, forwards: int) -> float:
        """Seconds of a round's `forwards` draft forwards in a step of this many rows (the nearest measured rows; an
        unmeasured count on the line through the measured ones)."""
        if forwards <= 0 or not self._draft_s:
            return 0.0
        return along(self._forwards(rows), forwards)

    def draft(self, rows: int) -> float:
        """Seconds one more draft forward adds to a round: the slope of draft_round (one count measured: its mean)."""
        if not self._draft_s:
            return 0.0
        table = self._forwards(rows)
        (f1, s1), (f2, s2) = sorted(table.items())[-2:] if len(table) > 1 else [(0, 0.0), *table.items()]
        slope = (s2 - s1) / (f2 - f1)
        # (noise can tilt two close counts the wrong way: then the mean of every forward timed)
        return slope if slope > 0 else sum(table.values()) / sum(table)

    def _forwards(self, rows: int) -> dict[int, float]:
        return self._draft_s[nearest(self._draft_s, rows)].priced(self.steps)

    def overhead(self, rows: int, drafted: bool) -> float:
        """Seconds a step of this many rows spends outside drafting and its pass (the nearest measured rows)."""
        same = [r for r, d in self._overhead_s if d == drafted]
        if not same:
            return 0.0
        return self._overhead_s[nearest(same, rows), drafted]

    def observe_overhead(self, rows: int, drafted: bool, seconds: float) -> None:
        decay_into(self._overhead_s, (rows, drafted), max(0.0, seconds))

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A lagging draft read `tokens` tokens of its text in `seconds` (Engine.catch_up_draft)."""
        if tokens > 0:
            spent, read, fillings = self._catch_up
            self._catch_up = DECAY * spent + seconds, DECAY * read + tokens, DECAY * fillings + 1

    def catch_up(self, tokens: float) -> float | None:
        """Seconds a lagging draft takes to read `tokens` tokens (None: no filling timed): a draft forward, which any
        filling pays once (the weights' read), and the rest by the token. Priced per token alone, a few short
        fillings (before a probe) made a prompt's reading look several times dearer than it runs, and a served
        request's draft was never filled: a filling of 3 tokens took 4.5 ms a token, one of 43 tokens 1.3 ms."""
        per_token = self.catch_up_s
        return None if per_token is None else self._filling_forward() + per_token * tokens

    @property
    def catch_up_s(self) -> float | None:
        """Seconds a token of reading adds to a filling, past its forward (catch_up); None: no filling timed."""
        spent, read, fillings = self._catch_up
        return (spent - fillings * self._filling_forward()) / read if read else None

    @catch_up_s.setter
    def catch_up_s(self, seconds: float | None) -> None:
        """Price a filling at `seconds` a token and nothing more (None: as never timed)."""
        self._catch_up = (0.0, 0.0, 0.0) if seconds is None else (seconds, 1.0, 0.0)

    def _filling_forward(self) -> float:
        """The forward a filling pays once: a draft forward's price, at most a filling's mean (0 before either)."""
        spent, _, fillings = self._catch_up
        return min(self.draft(1), spent / fillings) if fillings else 0.0

    def observe(self, rows: int, k: int, draft_s: float, verify_s: float, draft_steps: int | None = None) -> None:
        """One step of `rows` sequences, the widest drafting k tokens (a tree: k nodes) in draft_steps forwards
        (default k; a tree's depth): what drafting and verifying took."""
        self._clock[0] += 1
        self._verify_s.setdefault(rows, Timings()).observe(k + 1, verify_s, self.steps)
        steps = k if draft_steps is None else draft_steps
        if steps > 0:
            self._draft_s.setdefault(rows, Timings(along)).observe(steps, draft_s, self.steps)


class TreeSpread:
    """A sequence's nodes beside its deepest path, per round its draft length priced (a hybrid's lookup rounds
    apart, as for its acceptance), decayed: 0 for a chain, more for a tree, whose verification pass is as wide as
    all its nodes. Why the draft length needs it: k prices a pass of k + 1 positions, and a tree k deep is verified
    in a pass of k + 1 + this many. Without it a tree of several nodes at depth 1 whose guesses are seldom kept is
    priced as a 2-token pass and looks like it pays, while the wider pass it runs costs more than a plain step for
    little over one token. Beside the path, not per position: a grown tree's side branches sit mostly near its
    root (its likeliest alternatives), so a deeper tree is not proportionally wider, and pricing it per position
    would overcharge the deep trees that pay."""

    def __init__(self):
        self._side: dict[int, float] = {}  # {0: side nodes, decayed} once a round has drafted

    @property
    def side_nodes(self) -> float:
        return self._side.get(0, 0.0)  # a chain's, until a round says otherwise

    def observe(self, nodes: int, depth: int) -> None:
        if depth > 0:
            decay_into(self._side, 0, nodes - depth)


def decayed(old: float | None, value: float) -> float:
    """A running estimate after a new value: the value itself at first, then DECAY of the old and the rest of it."""
    return value if old is None else DECAY * old + (1 - DECAY) * value


def decay_into(table: dict[int, float], key: int, value: float) -> None:
    """table[key] := decayed(table.get(key), value)."""
    table[key] = decayed(table.get(key), value)
