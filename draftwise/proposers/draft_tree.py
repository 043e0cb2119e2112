"""A draft model proposes a token tree (EAGLE-2's dynamic tree, Li et al. 2024, grown by a plain draft model).

Why a tree: a chain of k guesses is lost from its first wrong token on; when the draft hesitates between two
tokens, offering both costs one wider target pass (on a GPU nearly free) and keeps whichever the target picks.

Growth: depth 1 is the BRANCH likeliest tokens after the text; each further depth expands up to WIDTH likeliest
frontier nodes (likeliness: the draft's probability of the whole path, the product along it, which tracks the
chance the target keeps it; as many as pay for their rows of the forward, measured by width: tree_growth.py) by
their BRANCH likeliest tokens, all in ONE draft forward. A depth-d node attends
to the text and its own ancestors only: the nodes fed by earlier forwards sit in the draft's cache after the
text, and the backend's tree mask (a layout longer than the forward's ids, backends/hf.py) hides the rest.
Of every node grown, the likeliest n are offered (a parent is at least as likely as its child and comes first
on a tie, so they form a tree): n = k for a fixed-size draft, else as many as pay for the wider pass by the
measured costs. Every guess is one-hot (q = None): the tree verifier is exact whatever is proposed, since the
candidates do not depend on the target's random draws.

Cache rule (the chain's, draft_model.py): between rounds the draft cache holds a prefix of the text. A round
feeds the text it lacks (its last token included, the tree's root), then the expanded nodes. After
verification keep_path() moves the kept path's fed nodes to right after the text and trims everything else;
a failed round (or an error while growing) trims back to the text. A leaf never expanded was never fed, like
the chain's last guess; it is fed next round with the bonus token.

In a batch (a server step), every tree sequence's depth goes in one draft forward with the other sequences' rows
(proposers/batch.py): the round runs in steps, growing() yields the nodes of the next depth and is sent their
candidates, so the draft model's weights are read once per depth for the whole batch instead of once per
sequence.
"""
from __future__ import annotations

import time
from dataclasses import replace
from itertools import takewhile

import torch

from draftwise.backends.base import Backend
from draftwise.proposers.compact import target_ids
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.tree_growth import BRANCH, GrownTree, SizedTree, TreeSizing, as_draft, growing
from draftwise.sampling import logits_to_probs
from draftwise.types import Draft, TreeLayout


class DraftTreeProposer(SizedTree, DraftModelProposer):
    # take() gets every fed row's logits: a depth of the tree is fed at once (batch.py)
    capabilities = replace(DraftModelProposer.capabilities, drafts_trees=True, takes_rows=True)

    def __init__(self, backend: Backend, target_vocab_size: int, token_ids: torch.Tensor | None = None,
                 sizing: TreeSizing | None = None):
        super().__init__(backend, target_vocab_size, token_ids)
        self.sizing = sizing or TreeSizing()  # how many grown nodes to offer (tree_growth.py)
        self._offered: tuple[int, ...] = ()  # the last Draft's tokens
        self._fed_at: dict[int, int] = {}  # a node of the last Draft that was fed -> its cache position
        self._growth = None  # this round's growing() generator, once the root's forward has run
        self._tree: GrownTree | None = None  # this round's grown tree, once growth stopped
        self._nodes: list[int] = []  # the nodes the pending forward feeds
        self._spec: list[int] = []  # the node of each speculative cache entry, in cache order (after the text)
        self._forwards, self._drafted_s, self._k = 0, 0.0, 0  # this round's forwards, and their seconds
        self._layout: TreeLayout | None = None  # the pending forward's tree (None: the text, the root last)

    def fork(self) -> "DraftTreeProposer":
        return DraftTreeProposer(self._model().open_slot(), self.target_vocab_size, self.token_ids,
                                 TreeSizing(self.sizing.costs, self.sizing.max_nodes))

    # -- a round, in steps (propose() runs them alone; batch.py in lockstep with other sequences) ------------
    def start(self, context: list[int], k: int, stop_confidence: float = 0.0) -> None:
        self._context_len, self._offered, self._fed_at = len(context), (), {}
        self._k, self._stop_confidence = k, stop_confidence
        self._growth, self._tree, self._nodes, self._spec, self._layout = None, None, [], [], None
        self._forwards, self._drafted_s = 0, 0.0
        self._feed = None
        if k < 1:
            return
        if len(self._cached) >= len(context):  # a round that failed after feeding the root: feed it again
            del self._cached[len(context) - 1 :]
            self.backend.trim(len(self._cached))
        self._feed = context[len(self._cached) :]  # >= 1 token: the text's last one (the root) is never cached

    def pending_layout(self) -> TreeLayout | None:
        """The pending forward's tree: the nodes fed before it (in the cache after the text) and its own, each
        seeing the text and its ancestors only (backends/hf.py); None for the text itself."""
        return self._layout

    def time_forward(self, seconds: float) -> None:
        """What the forward take() is about to read cost: alone, this tree's; in a batch, the shared one's."""
        self._drafted_s += seconds
        if self._growth is not None:  # a depth's forward (not the root's, whose width is the text's catch-up)
            self.sizing.time_expansion(len(self._nodes), seconds)

    def take(self, logits: torch.Tensor) -> None:
        """logits: [fed, draft_vocab], the draft's rows after the pending tokens (which the backend has cached)."""
        started = time.perf_counter()
        try:
            self._take(logits)
        finally:
            self._drafted_s += time.perf_counter() - started  # (choosing the candidates is part of drafting)

    def _take(self, logits: torch.Tensor) -> None:
        self._forwards += 1
        if self._growth is None:  # the root's forward: what follows the text
            self._cached += self._feed
            first = [row[0] for row in self._candidates(logits[-1:])]  # [BRANCH] each
            # (min_step: the chain's confidence rule)
            self._growth = growing(first, self._k, min_step=self._stop_confidence, sizing=self.sizing)
            self._advance(None)
        else:
            self._spec += self._nodes
            self._advance(self._candidates(logits))  # [len(nodes), BRANCH] each

    def _advance(self, children) -> None:
        """Hand the last forward's children to the growth; the next forward to run, or the grown tree."""
        try:
            tree, nodes = self._growth.send(children)
            while len(self._cached) + len(self._spec) + len(nodes) > self.backend.max_context:
                tree, nodes = self._growth.send(None)  # no room for another depth: growth stops
        except StopIteration as done:
            self._tree, self._feed, self._layout = done.value, None, None
            return
        self._nodes, self._feed = nodes, [tree.tokens[n] for n in nodes]
        order = [*self._spec, *nodes]  # the tree in the slot after this forward, the root before it
        index = {node: i for i, node in enumerate(order)}
        self._layout = TreeLayout.of(tuple(-1 if tree.parents[n] < 0 else index[tree.parents[n]] for n in order))

    def settle(self) -> None:
        """A round that did not grow its tree (an error) leaves nothing ahead of the text; a grown tree's fed
        nodes stay in the cache until keep_path()."""
        self._feed, self._growth, self._layout = None, None, None
        self._end_guided_round()  # (a tree's guesses are not guided: nothing was pushed, nothing to undo)
        if self._tree is None:
            self.backend.trim(len(self._cached))

    def finish(self) -> Draft:
        if self._tree is None:  # k < 1 (a round that failed never gets here)
            return Draft(token_ids=())
        try:
            self.sizing.time_forwards(self._drafted_s, self._forwards)
            fed = {node: len(self._cached) + i for i, node in enumerate(self._spec)}
            chosen = self.sizing.choose(self._tree, self._k, self._forwards)
            return self._offer(self._tree.tokens, self._tree.parents, fed, chosen)
        except BaseException:
            self.backend.trim(len(self._cached))  # no draft: nothing ahead of the text stays
            raise

    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [n, draft_vocab] -> (log-probabilities, target ids) of each row's BRANCH likeliest tokens, [n, b].

        Greedy ranks by the draft's own softmax; sampling by the probabilities the request samples from
        (temperature, top-k, top-p), so a token it could never emit is never offered."""
        if self.token_ids is None:
            logits = logits[:, : self.target_vocab_size]  # rows past the target's vocabulary are padding
        logits = logits.float()
        if self._sampling.greedy:
            log_p = torch.log_softmax(logits, -1)
        else:
            log_p = logits_to_probs(logits, self._sampling).log()
        top = log_p.topk(min(BRANCH, log_p.shape[-1]), dim=-1)
        return top.values.cpu(), target_ids(top.indices, self.token_ids).cpu()

    def _offer(self, tokens: list[int], parents: list[int], fed: dict[int, int], chosen: list[int]) -> Draft:
        """The chosen nodes as a Draft; remembers where its fed nodes sit in the cache."""
        draft, index = as_draft(tokens, parents, chosen)
        self._offered = draft.token_ids
        self._fed_at = {index[n]: at for n, at in fed.items() if n in index}
        return draft

    # -- after verification --------------------------------------------------------------------------------
    def observe(self, num_accepted: int) -> None:
        super().observe(num_accepted)
        self.sizing.observe(num_accepted)  # how far the tree's chances were borne out (TreeSizing.trust)

    def keep_path(self, path: list[int]) -> None:
        """path: the kept nodes of the last Draft, root's child first. Its fed nodes (a prefix of it: a fed node's
        parent was fed) move to right after the text, as a chain would have fed them; the rest of the tree goes."""
        fed = list(takewhile(lambda node: node in self._fed_at, path))
        try:
            if fed:
                self.backend.keep(len(self._cached), [self._fed_at[node] for node in fed])
                self._cached += [self._offered[node] for node in fed]
        finally:
            self._fed_at = {}
            self.backend.trim(len(self._cached))
