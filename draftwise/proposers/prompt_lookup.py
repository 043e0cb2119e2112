"""Prompt lookup: guess that the text continues as it did after the last place its tail occurred.

Free to run and strong on input-grounded text (summaries, code edits, RAG), where the output copies
spans of the prompt. The guess is one-hot, so Draft.q is None.

With a proposal cache (proposal_cache.py, shared by the engine's sequences) the text of earlier requests is
searched too: the longer of the two matches proposes, the request's own text on a tie (it is the more specific).

With branches > 1 (method lookup-tree) the guess is a token tree: the continuations (k tokens each) of the last
`branches` earlier occurrences of the matched tail, merged where they agree.

How much of a guess to offer. A sequence drafting a fixed k gets k tokens (a tree: k nodes, the most shared first,
then the shallower, then the more recent). Otherwise, once the engine has timed a pass, the guess is priced: the
chain (the most recent occurrence's continuation, what lookup alone would guess) has its node at depth d kept
with chance a^d, a being lookup's per-token acceptance after a match of this length; a node of the other
continuations (a tree's side branches) has its share of the continuations times a^d, times how far such side
nodes have been borne out in this sequence. The nodes are offered likeliest first, as many as the round planner
(planner.py) prices highest by the engine's measured pass costs (a free guess: no draft forward), and none where a
plain step prices higher.
So a tree is the chain plus side nodes that pay for their width, and a chain stops at the depth that pays.

Lookup learns in hindsight, for free: each guess (its chain, and its side branches' first nodes), offered or
not, is judged at the next guess against the tokens the target emitted since. Why every round and by match
length: a one-token match is mostly wrong in prose and mostly right in a summary that copies its article, and an
estimate learnt only from the rounds it drafted, turned off after a few misses, learns nothing until a probe:
replayed over one of the head's off-bench answers under the engine's shared draft length, lookup-tree missed its
first guesses and offered 35 nodes in the next 256 rounds, none kept, where lookup's chain, still drafting, took
183 rounds for the same 256 tokens. A match shorter than trusted_ngram starts pessimistic (SHORT_MATCH_PRIOR) and is offered only
on that evidence.

For the methods lookup and lookup-tree (not a hybrid's lookup, which the hybrid asks), the engine gives every
round to free_round (judges_rounds) instead of its shared draft length, which is learnt on drafted rounds alone;
until a pass is timed, that is a plain step. (Their Sequence.acceptance only marks them adaptive.) A hybrid-tree or hybrid-head's lookup is priced the same way (by the pair's shared sizing), so it may
offer nothing, and the draft model takes the round. The choice depends on the past alone, so the output stays exact.
"""
from __future__ import annotations

import torch

from draftwise import planner
from draftwise.estimates import DECAY, Acceptance, StepCosts
from draftwise.config import DEFAULT_LOOKUP_NGRAM, SamplingConfig
from draftwise.errors import DraftwiseError
from draftwise.proposers.base import Capabilities, Proposer
from draftwise.proposers.proposal_cache import ProposalCache
from draftwise.proposers.tree_growth import MAX_NODES, TreeSizing, followed_costs
from draftwise.types import Draft, chain_parents, common_prefix

# Matches shorter than this start pessimistic: a shorter shared tail (one token, a common pair such as ", the")
# recurs in any prose, and what followed it there is mostly wrong here.
TRUSTED_NGRAM = 3
# The per-token acceptance a guess after a shorter match starts from, as (kept, tried): none, worth two tokens.
# Lookup costs nothing to run, so any hope would win it rounds; each lost one costs a wider pass.
SHORT_MATCH_PRIOR = (0.0, 2.0)


class PromptLookupProposer(Proposer):
    def __init__(self, max_ngram: int = DEFAULT_LOOKUP_NGRAM, min_ngram: int = 1, corpus: ProposalCache | None = None,
                 branches: int = 1, trusted_ngram: int = TRUSTED_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise DraftwiseError(f"lookup n-gram sizes must satisfy 1 <= min <= max, got min={min_ngram} max={max_ngram}")
        if branches < 1:
            raise DraftwiseError(f"lookup branches must be >= 1, got {branches}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.branches = branches
        self.capabilities = Capabilities(drafts_trees=branches > 1, guesses_free=True, judges_rounds=True,
                                         keeps_estimates=True)
        self.trusted_ngram = min(trusted_ngram, max_ngram)  # (a lookup of shorter n-grams trusts its longest)
        self.sizing = TreeSizing() if branches > 1 else None  # a tree's costs (price_with)
        # The engine's step costs, which price a chain's depth (a tree's: its sizing's); None for a fixed k.
        self.costs: StepCosts | None = None
        self.last_match = 0  # tokens of the text's tail that the last guess matched (0: no guess)
        self.last_expected = 1.0  # tokens the last round is expected to emit, the target's own included
        self._rows = 1  # the rows of this round's step, which its guess's width is priced in (prepare_round)
        self.corpus = corpus  # earlier requests' texts, or None
        self.corpus_rounds = 0  # proposals this sequence took from the corpus
        self._follower: dict[tuple[int, ...], list[int]] = {}  # n-gram -> where its continuations start, oldest first
        self._indexed = 0  # context positions already in the index
        self._start_estimates()

    # A guess runs no draft forward: the engine leaves its rounds out of the seconds per draft forward, which a
    # draft model's rows in the same batch (and a chain hybrid's pick) are priced by. Nor does its tree widen
    # what the engine's draft length prices (TreeSpread): lookup sizes its own.
    drafted_free = True

    def price_with(self, costs: StepCosts, follow: bool) -> None:
        """Its guesses are priced by them (a tree's width by its sizing's) unless the sequence drafts a fixed k."""
        self.costs = costs if follow else None
        if self.sizing is not None:
            self.sizing.costs, self.sizing.sized_by_cost = costs, follow

    def attach_corpus(self, corpus: ProposalCache) -> None:
        self.corpus = corpus

    def _start_estimates(self) -> None:
        self._by_match: dict[int, Acceptance] = {}  # per-token acceptance of the chain, by match length
        self._carried: dict[str, float] = {}  # the engine's earlier sequences' rates, by estimate name
        # Side branches' first nodes judged where the text reached their parent: kept, and the chances claimed for
        # them there (share of the matches times a), decayed per round judged.
        self._side = [1.0, 1.0]
        self._shadow: tuple | None = None  # the last guess to judge: (match, chain, side claims, context length)
        self._armed: Draft | None = None  # free_round's guess, for the round it was made for

    def begin(self, prompt_ids: list[int], sampling: SamplingConfig, generator: torch.Generator) -> None:
        self._follower.clear()
        self._indexed = 0
        self.corpus_rounds = 0
        self._start_estimates()

    def propose(self, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
        armed, self._armed = self._armed, None
        if armed is not None:  # made and priced by free_round for this very round
            return armed
        self._learn(context)
        return self._guess(context, k, self._rows)

    def prepare_round(self, depth: int, rows: int = 1) -> None:
        self._rows = rows  # (a hybrid's lookup guesses in its rounds; alone, free_round is told the rows)

    def free_round(self, context: list[int], k: int, rows: int = 1) -> int:
        """The engine's k for this round of a lookup method: the priced guess's depth (see the module docstring),
        in a pass of `rows` rows whose others emit a token each; 0 for a plain step, which is all it takes before a
        pass is timed. Arms the round: propose() hands the guess over."""
        self._armed = None
        if followed_costs(self.sizing, self.costs) is None or k < 1:
            return 0
        self._learn(context)
        guess = self._guess(context, k, rows)
        self._armed = guess if guess.depth else None
        return guess.depth

    @property
    def armed_nodes(self) -> int:
        """The nodes of the guess free_round armed for this round (0: none): the pass's width beside the others'."""
        return len(self._armed) if self._armed is not None else 0

    def _guess(self, context: list[int], k: int, rows: int = 1) -> Draft:
        n, continuations = self._continuations(context, k)
        self.last_match, self.last_expected = n, 1.0
        if not continuations:
            return Draft(token_ids=())
        ranked = rank_nodes(continuations)
        costs = followed_costs(self.sizing, self.costs)
        if costs is None:  # a fixed k: k nodes (a chain's k tokens)
            self._shadow = (n, continuations[0], (), len(context))
            chosen = ranked[:k]
            self.last_expected = _expected(self.acceptance_after(n).rate, chosen, continuations[0], len(continuations))
            return token_tree(chosen)
        return self._priced(ranked, continuations, n, len(context), costs, rows)

    def _continuations(self, context: list[int], k: int) -> tuple[int, list[tuple[int, ...]]]:
        """(the match's length, what followed it: the most recent occurrence first), from the text or the corpus."""
        n, starts = self._own_match(context)
        if self.corpus is not None:
            corpus_n, corpus_guess = self.corpus.match(context, k)
            if corpus_n > n and corpus_n >= self.min_ngram and corpus_guess:
                self.corpus_rounds += 1
                return corpus_n, [tuple(corpus_guess)]
        return n, [tuple(context[s : s + k]) for s in reversed(starts[-self.branches:])]

    def _priced(self, ranked, continuations, n: int, at: int, costs: StepCosts, rows: int) -> Draft:
        """The likeliest nodes, as many as give the most expected tokens per second (none: a plain step)."""
        a, chain, shares = self.acceptance_after(n).rate, continuations[0], len(continuations)
        trust = self._side[0] / self._side[1] if self._side[1] > 0 else 1.0
        chances = [_chance(path, share, a, chain, shares) * (1.0 if _on(path, chain) else min(1.0, trust))
                   for path, share in ranked]
        order = sorted(range(len(ranked)), key=lambda i: (-chances[i], len(ranked[i][0]), i))
        offered, _ = planner.best_prefix(costs, [chances[i] for i in order], rows=rows, max_nodes=MAX_NODES,
                                         plain_step=True)
        self.last_expected = planner.expected_tokens(chances[i] for i in order[:offered])
        # Where a side branch leaves the chain: its chance there, given the chain reached its parent.
        claims = tuple((path, share / shares * a) for path, share in ranked
                       if not _on(path, chain) and _on(path[:-1], chain) and a > 0)
        self._shadow = (n, chain, claims, at)
        return token_tree([ranked[i] for i in order[:offered]])

    def _learn(self, context: list[int]) -> None:
        """Judge the last guess against the tokens emitted since (the accepted and the target's own): its chain,
        and each side branch's first node where the emitted text reached its parent."""
        if self._shadow is None:
            return
        n, chain, claims, at = self._shadow
        self._shadow = None
        emitted = tuple(context[at:])
        if not emitted:  # a new text, or a round that failed
            return
        self.acceptance_after(n).observe(min(len(chain), len(emitted)), common_prefix(chain, emitted))
        judged = [(emitted[len(path) - 1] == path[-1], claim) for path, claim in claims
                  if len(emitted) >= len(path) and emitted[: len(path) - 1] == path[:-1]]
        if judged:
            self._side = [DECAY * self._side[0] + sum(kept for kept, _ in judged),
                          DECAY * self._side[1] + sum(claim for _, claim in judged)]

    def acceptance_after(self, match: int) -> Acceptance:
        """Lookup's per-token acceptance after a match of this many tokens."""
        if match not in self._by_match:
            acceptance = Acceptance(*SHORT_MATCH_PRIOR) if match < self.trusted_ngram else Acceptance()
            acceptance.start_from(self._carried.get(lookup_estimate(match)))
            self._by_match[match] = acceptance
        return self._by_match[match]

    def acceptances(self) -> dict[str, Acceptance]:
        """This sequence's estimates by name, what the engine carries to the next sequence of the method."""
        return {lookup_estimate(match): acceptance for match, acceptance in self._by_match.items()}

    def start_acceptances(self, rates: dict[str, float]) -> None:
        """Start each estimate from what the engine's earlier sequences kept (made as matches first occur)."""
        self._carried = dict(rates)

    def _own_match(self, context: list[int]) -> tuple[int, list[int]]:
        """(n, where the continuations of the earlier occurrences of the context's last n tokens start, oldest
        first) for the longest n that occurred before."""
        self._index(context)
        # Longer matches first: a longer shared tail predicts the continuation better.
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            starts = self._follower.get(tuple(context[-n:]))
            if starts:
                return n, starts
        return 0, []

    def observe(self, num_accepted: int) -> None:
        pass  # lookup learns at its next guess, from what the target emitted (_learn)

    def fork(self) -> "PromptLookupProposer":
        return PromptLookupProposer(self.max_ngram, self.min_ngram, self.corpus, self.branches, self.trusted_ngram)

    def _index(self, context: list[int]) -> None:
        """Record, for every n-gram that now has a token after it, where that token is (O(new tokens))."""
        if len(context) < self._indexed:  # a different sequence: start over
            self._follower.clear()
            self._indexed = 0
        for follower in range(max(self._indexed, 1), len(context)):
            for n in range(self.min_ngram, min(self.max_ngram, follower) + 1):
                self._follower.setdefault(tuple(context[follower - n : follower]), []).append(follower)
        self._indexed = max(self._indexed, len(context))


def lookup_estimate(match: int) -> str:
    """The name of lookup's acceptance after a match of this many tokens, among the estimates an engine carries."""
    return f"lookup after {match}"


def _on(path: tuple[int, ...], chain: tuple[int, ...]) -> bool:
    """Whether the path runs along the chain (the root's empty path does)."""
    return path == chain[: len(path)]


def _chance(path: tuple[int, ...], share: int, a: float, chain: tuple[int, ...], shares: int) -> float:
    """A node's chance of being kept, before the side branches' trust: a^depth on the chain, else its share of the
    continuations times that."""
    return a ** len(path) * (1.0 if _on(path, chain) else share / shares)


def _expected(a: float, chosen, chain: tuple[int, ...], shares: int) -> float:
    return planner.expected_tokens(_chance(path, share, a, chain, shares) for path, share in chosen)


def rank_nodes(continuations: list[tuple[int, ...]]) -> list[tuple[tuple[int, ...], int]]:
    """Every node of the continuations (most recent first) merged into one tree, as (its path from the root, its
    share: how many continuations pass through it), in the order to offer them: the most shared first, then the
    shallower, then the more recent. A node's parent shares at least as many, so every prefix is a tree."""
    nodes: dict[tuple[int, ...], list[int]] = {}  # path from the root -> [share, first seen]
    for continuation in continuations:
        for depth in range(1, len(continuation) + 1):
            entry = nodes.setdefault(continuation[:depth], [0, len(nodes)])
            entry[0] += 1
    ranked = sorted(nodes, key=lambda path: (-nodes[path][0], len(path), nodes[path][1]))
    return [(path, nodes[path][0]) for path in ranked]


def token_tree(ranked: list[tuple[tuple[int, ...], int]]) -> Draft:
    """Ranked nodes (a prefix of rank_nodes's) as a Draft; a chain when they are one."""
    chosen = sorted((path for path, _ in ranked), key=len)  # parents before children (a stable sort)
    index = {path: i for i, path in enumerate(chosen)}
    tokens = tuple(path[-1] for path in chosen)
    parents = tuple(index.get(path[:-1], -1) for path in chosen)
    return Draft(token_ids=tokens, parents=None if parents == chain_parents(len(tokens)) else parents)
