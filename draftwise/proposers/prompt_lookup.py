"""Prompt lookup: guess that the text continues as it did after the last place its tail occurred.

Free to run and strong on input-grounded text (summaries, code edits, RAG), where the output copies
spans of the prompt. The guess is one-hot, so Draft.q is None.

With a proposal cache (proposal_cache.py, shared by the engine's sequences) the text of earlier requests is
searched too: the longer of the two matches proposes, the request's own text on a tie (it is the more specific).

With branches > 1 (method lookup-tree) the guess is a token tree: the continuations (k tokens each) of the last
`branches` earlier occurrences of the matched tail, merged where they agree. The nodes that most occurrences
share come first (then the shallower, then the more recent). How many are offered is the tree proposers' rule
(tree_growth.TreeSizing): exactly k for a sequence drafting a fixed k; otherwise as many as pay for the wider
pass by the engine's measured costs, a node's chance of being kept taken as its share of the occurrences times
a^depth, where a is this lookup's own measured per-token acceptance.
"""
from __future__ import annotations

import torch

from draftwise.adaptive import Acceptance
from draftwise.config import SamplingConfig
from draftwise.errors import DraftwiseError
from draftwise.proposers.proposal_cache import ProposalCache
from draftwise.proposers.tree_growth import TreeSizing
from draftwise.types import Draft
from draftwise.verify.tree import chain_parents


class PromptLookupProposer:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, corpus: ProposalCache | None = None,
                 branches: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise DraftwiseError(f"lookup n-gram sizes must satisfy 1 <= min <= max, got min={min_ngram} max={max_ngram}")
        if branches < 1:
            raise DraftwiseError(f"lookup branches must be >= 1, got {branches}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.branches = branches
        self.sizing = TreeSizing() if branches > 1 else None  # a tree's node count (the engine sets its costs)
        self._acceptance = Acceptance()  # per token, for the chance a node is kept
        self._depth = 0  # of the last guess
        self.last_match = 0  # tokens of the text's tail that the last guess matched (0: no guess)
        self.corpus = corpus  # earlier requests' texts, or None
        self.corpus_rounds = 0  # proposals this sequence took from the corpus
        self._use_corpus = True
        self._follower: dict[tuple[int, ...], list[int]] = {}  # n-gram -> where its continuations start, oldest first
        self._indexed = 0  # context positions already in the index

    # A guess runs no draft forward: the engine leaves its rounds out of the seconds per draft forward, which a
    # draft model's rows in the same batch (and a chain hybrid's pick) are priced by.
    drafted_free = True

    def begin(self, prompt_ids: list[int], sampling: SamplingConfig, generator: torch.Generator) -> None:
        self._follower.clear()
        self._indexed = 0
        self.corpus_rounds = 0
        self._acceptance = Acceptance()
        # A seeded sampled sequence must give the same text every time: its random draws follow the round shapes,
        # which other requests' texts would change. It looks up its own text only.
        self._use_corpus = sampling is None or sampling.greedy or sampling.seed is None

    def propose(self, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
        guess = self._guess(context, k)
        self._depth = guess.depth
        return guess

    def _guess(self, context: list[int], k: int) -> Draft:
        n, starts = self._own_match(context)
        if self.corpus is not None and self._use_corpus:
            corpus_n, corpus_guess = self.corpus.match(context, k)
            if corpus_n > n and corpus_n >= self.min_ngram and corpus_guess:
                self.corpus_rounds += 1
                self.last_match = corpus_n
                return Draft(token_ids=corpus_guess)
        self.last_match = n
        if not starts:
            return Draft(token_ids=())
        ranked = rank_nodes([tuple(context[s : s + k]) for s in reversed(starts[-self.branches:])])
        budget = k
        if self.sizing is not None:
            a, matches = self._acceptance.rate, min(len(starts), self.branches)
            budget = self.sizing.how_many([share / matches * a ** len(path) for path, share in ranked], k, 0.0)
        return token_tree(ranked[:budget])

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
        self._acceptance.observe(self._depth, num_accepted)

    def fork(self) -> "PromptLookupProposer":
        return PromptLookupProposer(self.max_ngram, self.min_ngram, self.corpus, self.branches)

    def release(self) -> None:
        pass

    def _index(self, context: list[int]) -> None:
        """Record, for every n-gram that now has a token after it, where that token is (O(new tokens))."""
        if len(context) < self._indexed:  # a different sequence: start over
            self._follower.clear()
            self._indexed = 0
        for follower in range(max(self._indexed, 1), len(context)):
            for n in range(self.min_ngram, min(self.max_ngram, follower) + 1):
                self._follower.setdefault(tuple(context[follower - n : follower]), []).append(follower)
        self._indexed = max(self._indexed, len(context))


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
