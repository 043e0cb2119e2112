"""What the tree proposers (a draft model's, draft_tree.py; a feature head's, feature_head.py) share: how big a
grown tree to offer, and how to hand the chosen nodes over as a Draft. Prompt lookup's trees (prompt_lookup.py)
are sized by the same rule.

Growth (EAGLE-2, Li et al. 2024): depth 1 is the BRANCH likeliest tokens after the text; each further depth expands
up to the WIDTH likeliest frontier nodes (see "Depth and width" below), likeliness being the proposer's probability
of the whole path (the product along it, which tracks how likely the target is to keep the path). Of every node
grown, the likeliest n are offered: a parent is at least as likely as its child and comes first on a tie, so they
form a tree.

n: exactly k for a sequence that drafts a fixed k (a seeded sampled request's random draws follow the round
shapes, which timings must not move); otherwise the n that the round planner (planner.py) prices highest, each
node kept with its path probability, after the forwards the tree took, by what the engine measured on this machine
(StepCosts): the tree widens while a wider pass pays for itself and backs off where it stops paying (a CPU that
emulates bfloat16 pays for every token of width).

Depth and width: a forward expands only the nodes that pay for their rows of it (TreeSizing.to_expand), and
growth stops before a forward none of whose nodes would: the nodes it would expand can add at most their own path
probabilities to the round's expected tokens, and if that is less than what the forward's seconds earn at the
rate of the tree already grown, no later depth can pay either. A proposer unsure of its next guesses then stops
instead of drafting depths none of whose nodes would be offered; one sure of its first guess and unsure of the
others expands that one alone, for what a one-row forward costs (on a CPU a 4-row forward of a small draft costs
more than a 1-row one: a tree that is a chain in all but its forwards would draft more dearly than the chain). A fixed k
grows to k, WIDTH nodes a depth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from draftwise import planner
from draftwise.estimates import StepCosts, Timings, interpolate
from draftwise.types import Draft, chain_parents

BRANCH = 4  # children grown per expanded node
WIDTH = 4  # nodes expanded per depth (one forward)
MAX_NODES = 24  # the widest tree offered to the cost model
DECAY = 0.9  # weight of the past in the trust by depth (the timings decay by estimates.DECAY, in Timings)


class TreeSizing:
    """A tree proposer's sizing state: the engine's costs, whether to follow them, its own forward time, and how
    far its own chances are borne out at each depth."""

    def __init__(self, costs: StepCosts | None = None, max_nodes: int = MAX_NODES):
        self.costs = costs  # the engine's measured step costs (its proposer's price_with); None: trees of k nodes
        self.max_nodes = max_nodes
        self.sized_by_cost = True  # False for a sequence drafting a fixed k (price_with)
        # The rows of this round's step (its proposer's prepare_round): a tree's width is priced in them, since a
        # wide pass at one row costs little more than a plain step (memory-bound) and at several rows many
        # (compute-bound; docs/experiments/throttle-zen4, section 3).
        self.rows = 1
        self._forward_s = Timings()  # seconds per proposer forward (one shape, 1), measured
        self._expansion_s = Timings()  # seconds of a forward that expands a depth, by its nodes, decayed
        # By depth, decayed: rounds whose kept path reached it, and the chances the offered nodes there claimed.
        self._kept_at: dict[int, float] = {}
        self._claimed_at: dict[int, float] = {}
        self._unoffered_for: dict[int, int] = {}  # by depth: rounds since a node there was last offered
        self._claimed: dict[int, float] = {}  # the last offered tree's claims by depth, until observed

    @property
    def by_cost(self) -> bool:
        """Whether sizes follow the measured costs: the sequence may (not a fixed k) and a pass has been timed."""
        return self.sized_by_cost and self.costs is not None and self.costs.measured

    @property
    def _now(self) -> int:  # the engine's step clock, which stale timings are judged by
        return self.costs.steps if self.costs is not None else 0

    @property
    def forward_s(self) -> float | None:
        """Seconds per proposer forward, measured; None before the first, or once stale (Timings): a proposer
        priced by a forward timed in a slow spell loses every round a cheaper one can win (a hybrid's lookup), and
        would never be timed again. Unmeasured, the tree hybrid picks by rule and its draft model gets rounds."""
        if self._forward_s.stale(1, self._now):
            return None
        return self._forward_s.seconds.get(1)

    @forward_s.setter
    def forward_s(self, seconds: float) -> None:
        self._forward_s.seconds[1] = seconds

    def time_forwards(self, seconds: float, forwards: int) -> None:
        self._forward_s.observe(1, seconds / max(1, forwards), self._now)

    def time_expansion(self, nodes: int, seconds: float) -> None:
        """What a forward expanding this many nodes of a depth cost (in a batch, the shared forward's time)."""
        self._expansion_s.observe(nodes, seconds, self._now)

    def expansion_cost(self, nodes: int) -> float:
        """Seconds of a forward expanding this many nodes: measured, else interpolated between measured widths.
        Unmeasured widths are priced as optimists, so that they get tried: a wider one as the widest measured, a
        narrower one in proportion to the narrowest. Nothing measured by width: the mean forward."""
        table = self._expansion_s.priced(self._now)
        if not table:
            return self.forward_s
        narrowest = min(table)
        if nodes < narrowest:
            return table[narrowest] * nodes / narrowest
        return interpolate(table, nodes)

    def trust(self, depth: int) -> float:
        """The share of the proposer's own chances at this depth that the target bore out: kept over claimed, at
        most 1 (a proposer that underrates itself is taken at its word). A head trained on little data is sure
        of guesses the target keeps a fraction of the time; taken at its word, it would grow and offer nodes
        that do not pay. A depth never offered is trusted as the deepest one measured above it (a proposer wrong
        at depth 1 is no better at depth 2). A property of the proposer, kept across its sequences, as its forward
        time is.

        A measured depth not offered since fades back to the trust of the depth above it, by DECAY a round: only
        offered depths are measured, so a depth that once did badly (a prompt the draft could not follow) would
        otherwise keep its low trust, never be grown or offered again, and never be measured again, on prompts
        where it would pay."""
        measured = max((d for d in self._claimed_at if d <= depth), default=None)
        if measured is None:
            return 1.0
        own = min(1.0, self._kept_at[measured] / self._claimed_at[measured])
        fade = DECAY ** self._unoffered_for.get(measured, 0)
        return fade * own + (1.0 - fade) * self.trust(measured - 1)

    def observe(self, num_accepted: int) -> None:
        """After the round of the last tree chosen: its kept path reached depth num_accepted."""
        for depth in self._claimed_at:
            self._unoffered_for[depth] = self._unoffered_for.get(depth, 0) + 1  # an offered one is reset below
        for depth, claimed in self._claimed.items():
            self._kept_at[depth] = DECAY * self._kept_at.get(depth, 1.0) + (num_accepted >= depth)
            self._claimed_at[depth] = DECAY * self._claimed_at.get(depth, 1.0) + claimed
            self._unoffered_for[depth] = 0
        self._claimed = {}

    def chance(self, tree: "GrownTree", node: int) -> float:
        """The node's chance of being kept: its path probability, as far as the proposer is trusted there."""
        return math.exp(tree.scores[node]) * self.trust(tree.depths[node])

    def choose(self, tree: "GrownTree", k: int, forwards: int | None = None) -> list[int]:
        """The nodes to offer (indices into the tree), likeliest first, after `forwards` proposer forwards this
        round (default k)."""
        scores = tree.scores
        order = sorted(range(len(scores)), key=lambda n: (-scores[n], n))  # a parent before its child on a tie
        if self.forward_s is None:
            chosen = order[:k]
        else:
            chosen = order[: self.how_many([self.chance(tree, n) for n in order], k, forwards or k)]
        self._claimed = {}
        for node in chosen:
            depth = tree.depths[node]
            self._claimed[depth] = self._claimed.get(depth, 0.0) + math.exp(scores[node])
        return chosen

    def to_expand(self, tree: "GrownTree", nodes: list[int], forwards: int) -> list[int]:
        """Which of `nodes` (likeliest first) one more forward should expand, in a round that has run `forwards`:
        the first w, for the w whose gain most exceeds its price, or none when no w's does. Expanding a node adds
        at most its own path probability (as far as the next depth is trusted) to the round's expected tokens;
        the forward's seconds are priced at the rate of the best tree already grown, which no later depth can
        beat if this one cannot (each adds at most as much, for as much). What decides is the proposer's
        confidence: a head unsure past its first guess stops there instead of paying for depths no node of which
        would be offered, and a draft sure of one guess expands it alone."""
        if not self.by_cost or self.forward_s is None:
            return nodes  # a fixed k (its tree has k nodes, whatever the costs), or nothing measured: grow to k
        probs = sorted((self.chance(tree, node) for node in range(len(tree.scores))), reverse=True)
        _, rate = self._best(probs, forwards)
        gains = accumulate(math.exp(tree.scores[n]) * self.trust(tree.depths[n] + 1) for n in nodes)  # first w's
        surplus = [planner.surplus(gain, self.expansion_cost(w), rate) for w, gain in enumerate(gains, 1)]
        best = max(range(len(surplus)), key=surplus.__getitem__, default=-1)
        return nodes[: best + 1] if best >= 0 and surplus[best] > 0 else []

    def how_many(self, probs: list[float], k: int, forwards: int) -> int:
        """How many nodes to offer: probs are the chances each node is kept, in the order they would be offered
        (a parent before its child), after `forwards` proposer forwards."""
        if not self.by_cost or not probs:
            return min(k, len(probs))
        return self._best(probs, forwards)[0]

    def _best(self, probs: list[float], forwards: int) -> tuple[int, float]:
        """(n, the round's expected tokens per second) for the n of the first nodes (at most max_nodes) whose offer
        the planner prices highest, after `forwards` of this proposer's forwards."""
        return planner.best_prefix(self.costs, probs, rows=self.rows, forwards=forwards, forward_s=self.forward_s,
                                   max_nodes=self.max_nodes)


class SizedTree:
    """What a proposer of grown trees (a draft model's, a head's) tells its sizing: the engine's costs at open, and
    each round the rows its width is priced in."""

    sizing: TreeSizing

    def price_with(self, costs: StepCosts, follow: bool) -> None:
        """The tree's width by what passes cost here; a fixed k means a fixed tree size too."""
        self.sizing.costs, self.sizing.sized_by_cost = costs, follow

    def prepare_round(self, depth: int, rows: int = 1) -> None:
        self.sizing.rows = rows


def followed_costs(sizing: TreeSizing | None, costs: StepCosts | None) -> StepCosts | None:
    """The measured step costs a proposer's rounds are priced by, where its sequence may follow them (not a fixed
    k, whose rounds a seed must reproduce): a tree proposer's sizing's, else those the engine gave it."""
    if sizing is not None:
        return sizing.costs if sizing.by_cost else None
    return costs if costs is not None and costs.measured else None


@dataclass
class GrownTree:
    """Every node grown so far, numbered parents first: its target token id, parent (-1: the root, the text's
    last token) and cumulative log-probability (of the whole path)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # 1 for the root's children

    def add_children(self, parent: int, log_p: torch.Tensor, ids: torch.Tensor) -> list[int]:
        """log_p, ids: [b] the candidates after `parent`; those with a chance of being kept become its children."""
        base = self.scores[parent] if parent >= 0 else 0.0
        added = []
        for score, token in zip(log_p.tolist(), ids.tolist()):
            if score > float("-inf"):  # sampling's top-k/top-p left it no chance of being kept
                added.append(len(self.tokens))
                self.tokens.append(token), self.parents.append(parent), self.scores.append(base + score)
                self.depths.append(self.depths[parent] + 1 if parent >= 0 else 1)
        return added

    def step_probability(self, node: int) -> float:
        """The proposer's probability of the node's token given its parent."""
        parent = self.parents[node]
        return math.exp(self.scores[node] - (self.scores[parent] if parent >= 0 else 0.0))


def grow(first: tuple[torch.Tensor, torch.Tensor], depth: int, expand, min_step: float = 0.0,
         sizing: TreeSizing | None = None) -> GrownTree:
    """Grow up to `depth` levels (see the module docstring). first: (log-probabilities [b], target ids [b]) of the
    candidates after the text. expand(tree, nodes) runs one forward over `nodes` (one depth) and returns their
    children's candidates, (log_p [n, b], ids [n, b]), or None when it may not (no room left)."""
    steps = growing(first, depth, min_step, sizing)
    try:
        request = next(steps)
        while True:
            request = steps.send(expand(*request))
    except StopIteration as done:
        return done.value


def growing(first: tuple[torch.Tensor, torch.Tensor], depth: int, min_step: float = 0.0,
            sizing: TreeSizing | None = None):
    """grow() as a generator, for a proposer whose forwards run in lockstep with other sequences' (batch.py): it
    yields (tree, nodes) for each forward to run, is sent their children's candidates (or None: it may not run),
    and returns the tree. A node whose own probability is below min_step is not expanded: its children would build
    on a doubtful guess. With a sizing, a forward expands only the nodes that pay, and growth stops where none does
    (TreeSizing.to_expand); the round has run one forward for `first` and one per depth since."""
    tree = GrownTree()
    frontier = tree.add_children(-1, *first)
    for forwards in range(1, depth):
        nodes = sorted((n for n in frontier if tree.step_probability(n) >= min_step),
                       key=lambda n: (-tree.scores[n], n))[:WIDTH]
        if nodes and sizing is not None:
            nodes = sizing.to_expand(tree, nodes, forwards)
        children = (yield tree, nodes) if nodes else None
        if children is None:
            break
        frontier = [child for row, node in enumerate(nodes) for child in tree.add_children(node, children[0][row],
                                                                                             children[1][row])]
    return tree


def as_draft(tokens: list[int], parents: list[int], chosen: list[int]) -> tuple[Draft, dict[int, int]]:
    """The chosen nodes (closed under parents; nodes are numbered parents first) as a Draft, a chain when they are
    one, and each chosen node's index in it."""
    keep = sorted(chosen)
    index = {node: i for i, node in enumerate(keep)}
    new_parents = tuple(-1 if parents[n] < 0 else index[parents[n]] for n in keep)
    ids = tuple(tokens[n] for n in keep)
    return Draft(token_ids=ids, parents=None if new_parents == chain_parents(len(ids)) else new_parents), index
