"""The price of a speculative round: expected tokens per second, from what was measured. Every choice of how much
to draft asks it (the draft length, adaptive.py; prompt lookup's depth; a hybrid's pick between lookup and its
draft; a tree's size, tree_growth.py; the skip calibration's layer count), and none keeps arithmetic of its own.

A row offers nodes; node i is kept with chance p_i, the chance its whole path is (a chain at per-token rate a:
a^d at depth d; a tree's node: its path probability as far as its proposer is trusted; a lookup node: its share
of the continuations times a^d). The row then emits on average

    tokens = 1 + sum_i p_i                        (the target's own token, plus each node kept)
           = (1 - a^(k+1)) / (1 - a)  for a chain of k at rate a   (Leviathan et al.; k + 1 at a = 1)

A step of `rows` rows drafts in lockstep, then verifies every row in one target pass padded to the widest:

    seconds = draft_round(rows, forwards) + verify(rows, width + 1) + overhead(rows)
    rate    = (sum of the offering rows' tokens + 1 for each other row) / seconds

forwards: the deepest offer's draft forwards (a chain's k, a tree's depth, 0 for a guess already made, prompt
lookup's: it is free); draft_round: their seconds (measured by forwards at this many rows, unless the proposer timed
its own forward); width: the most nodes any row offers; overhead: what a step costs outside both (choosing,
committing, accepting), which fewer, longer rounds save. They come from Prices: what the engine
measured (estimates.StepCosts), or flat prices (one pass costs the same at any width: a calibration's, or
Leviathan's units, in which rate is his speedup (1 - a^(k+1)) / ((1 - a)(k c + 1))). A plain step offers nothing:
rows / verify(rows, 1); a candidate pays only if its rate beats that.

Before a draft model drafts for a sequence, it reads the text it lacks (a new request's prompt, what lookup rounds
wrote): a cost paid once, not a round's. It pays when the tokens still to come, each as much cheaper as drafting
makes a token of the batch, repay it (catch_up_pays).

The price depends on the past alone (measured costs, acceptance so far), so any choice made by it keeps the output
the target's own.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Iterable, Protocol, Sequence

# How many times over a lagging draft's filling must be repaid in a batch (catch_up_pays): the reading's cost is sure,
# the saving a prediction, and a filled draft in a batch drafts only once its batch-mates' are filled too (with a
# smaller margin, fillings cost a visible share of a run and enabled hardly any drafting). A sequence alone drafts
# as soon as its own is filled: there, once (a margin of 2 alone kept some requests from drafting at all, and lost
# to off). Both: docs/experiments/throttle-zen4, section 9.
CATCH_UP_MARGIN = 2.0


class Prices(Protocol):
    """Seconds of a step's parts: estimates.StepCosts is the engine's, measured as it runs."""

    def draft(self, rows: int) -> float:
        """Seconds one more draft forward adds to a round in a step of this many rows."""

    def draft_round(self, rows: int, forwards: int) -> float:
        """Seconds of a round's `forwards` draft forwards in a step of this many rows."""

    def overhead(self, rows: int, drafted: bool) -> float:
        """Seconds a step spends outside its draft forwards and its pass (drafted: it offered a guess)."""

    def verify(self, rows: int, n: float) -> float:
        """Seconds of a target pass of this many rows, each n positions wide."""


@dataclass(frozen=True)
class FlatPrices:
    """Prices that do not change with the shape: a draft forward costs draft_s, any pass pass_s (a calibration that
    timed one shape; Leviathan's units, a pass costing one target step and a forward c of one)."""

    draft_s: float
    pass_s: float = 1.0

    def draft(self, rows: int) -> float:
        return self.draft_s

    def draft_round(self, rows: int, forwards: int) -> float:
        return self.draft_s * forwards

    def overhead(self, rows: int, drafted: bool) -> float:
        return 0.0

    def verify(self, rows: int, n: float) -> float:
        return self.pass_s


def expected_tokens(chances: Iterable[float]) -> float:
    """Tokens a row emits in a round that offers nodes kept with these chances: the target's own, plus theirs."""
    return 1.0 + sum(chances)


def chain(a: float | Sequence[float], k: int) -> list[float]:
    """The chances of a chain's k nodes: a^d at depth d for a per-token rate a; for per-position rates
    (a[i]: the chance the (i+1)-th token is kept once those before it were), their running product."""
    if isinstance(a, (int, float)):
        return [a ** d for d in range(1, k + 1)]
    return list(accumulate(a[:k], lambda kept, rate: kept * rate))


def chain_tokens(a: float, k: float) -> float:
    """expected_tokens(chain(a, k)) in closed form, which holds for a mean k too (a run's rounds of mixed k)."""
    return k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(frozen=True)
class Offer:
    """What one row puts into a round: the tokens it is expected to emit, the nodes it adds to the pass, and the draft
    forwards it needs first (0: its guess is already made)."""

    tokens: float = 1.0
    width: float = 0
    forwards: int = 0

    @classmethod
    def of_chain(cls, a: float, k: int, spread: float = 0.0) -> "Offer":
        """A chain of k at per-token rate a, drafted a forward a token; a tree k deep is priced so too, with its
        `spread` nodes beside the path widening the pass (estimates.TreeSpread)."""
        return cls(chain_tokens(a, k), k + spread if k and spread else k, k)

    @classmethod
    def of_nodes(cls, chances: Sequence[float], forwards: int = 0) -> "Offer":
        """Nodes kept with these chances (a tree's, or a chain's), after `forwards` draft forwards."""
        return cls(expected_tokens(chances), len(chances), forwards)


def round_seconds(prices: Prices, rows: int, width: float, forwards: int = 0, forward_s: float | None = None) -> float:
    """What a step costs: `forwards` draft forwards (a round's as prices time them at this many rows, or forward_s
    each: a proposer's own timing), then one pass of `rows` rows padded to width + 1 positions, and the step's
    overhead outside both."""
    drafting = 0.0
    if forwards:
        drafting = prices.draft_round(rows, forwards) if forward_s is None else forward_s * forwards
    return drafting + prices.verify(rows, width + 1) + prices.overhead(rows, width > 0)


def rate(prices: Prices, rows: int, offers: Sequence[Offer] = (), forward_s: float | None = None) -> float:
    """Expected tokens per second of a step of `rows` rows in which these offers are made and the other rows take
    a plain token each: the pass as wide as the widest offer, the forwards as many as the deepest's."""
    tokens = sum(offer.tokens for offer in offers) + (rows - len(offers))
    width = max((offer.width for offer in offers), default=0)
    forwards = max((offer.forwards for offer in offers), default=0)
    return tokens / round_seconds(prices, rows, width, forwards, forward_s)


def best_prefix(prices: Prices, chances: Sequence[float], rows: int = 1, forwards: int = 0,
                forward_s: float | None = None, max_nodes: int | None = None,
                plain_step: bool = False) -> tuple[int, float]:
    """(n, its rate) for the n whose offer of the first n nodes (chances in offer order, a parent before its child;
    at most max_nodes) gives the highest rate; with plain_step n may be 0 (offer nothing). The forwards that grew
    them are paid whatever n is."""
    chances = list(chances[:max_nodes])
    sizes = range(0 if plain_step else 1, len(chances) + 1)
    rates = [rate(prices, rows, [Offer.of_nodes(chances[:n], forwards)], forward_s) for n in sizes]
    best = max(range(len(rates)), key=rates.__getitem__)
    return sizes[best], rates[best]


def surplus(tokens: float, seconds: float, at_rate: float) -> float:
    """What spending `seconds` more for `tokens` more gains over the rate already had (> 0: it pays)."""
    return tokens - at_rate * seconds


def saving_per_token(plain_rate: float, rate: float) -> float:
    """Seconds a token of the batch takes less at `rate` (tokens/s, drafting) than at plain_rate (0 if it is slower)."""
    return max(0.0, 1.0 / plain_rate - 1.0 / rate) if plain_rate > 0 and rate > 0 else 0.0


def catch_up_pays(saving: float, tokens_to_come: float, reading_s: float, margin: float = 1.0) -> bool:
    """Whether filling a lagging draft, which takes reading_s seconds, is repaid by drafting for the tokens its
    sequence has still to come, each `saving` seconds (saving_per_token) cheaper. A draft model reads a new request's
    whole prompt before it drafts: for a short answer to a long prompt in a batch, where drafting saves little a
    token, that reading costs more than the drafting it enables saves. Repaid `margin` times over
    (DraftLengthPolicy: CATCH_UP_MARGIN in a batch)."""
    return saving * tokens_to_come > margin * reading_s


def break_even_chance(prices: Prices, rows: int) -> float:
    """The chance a draft token must have of being kept to pay for its forward: a forward's seconds as a share of
    a pass that verifies one draft token."""
    return prices.draft(rows) / prices.verify(rows, 2)


def leviathan_speedup(a: float, k: float, c: float) -> float:
    """Leviathan et al.'s speedup of chains of k at rate a, a draft forward c of a target step: the rate, in units
    of a target step whatever its width, over a plain step's (1)."""
    return rate(FlatPrices(draft_s=c), 1, [Offer.of_chain(a, k)])
