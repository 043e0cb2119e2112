"""A draft model proposes a token tree (EAGLE-2's dynamic tree, Li et al. 2024, grown by a plain draft model).

Why a tree: a chain of k guesses is lost from its first wrong token on; when the draft hesitates between two
tokens, offering both costs one wider target pass (on a GPU nearly free) and keeps whichever the target picks.

Growth: depth 1 is the BRANCH likeliest tokens after the text; each further depth expands the WIDTH likeliest
frontier nodes (likeliness: the draft's probability of the whole path, the product along it, which tracks the
chance the target keeps it) by their BRANCH likeliest tokens, all in ONE draft forward. A depth-d node attends
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
"""
from __future__ import annotations

import time
from itertools import takewhile

import torch

from draftwise.backends.base import Backend
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.tree_growth import BRANCH, TreeSizing, as_draft, grow
from draftwise.sampling import logits_to_probs
from draftwise.types import Draft
from draftwise.verify.tree import TreeLayout


class DraftTreeProposer(DraftModelProposer):
    steps_in_lockstep = False  # its forwards are trees, not one row per sequence: propose_many lets it propose()

    def __init__(self, backend: Backend, target_vocab_size: int, token_ids: torch.Tensor | None = None,
                 sizing: TreeSizing | None = None):
        super().__init__(backend, target_vocab_size, token_ids)
        self.sizing = sizing or TreeSizing()  # how many grown nodes to offer (tree_growth.py)
        self._offered: tuple[int, ...] = ()  # the last Draft's tokens
        self._fed_at: dict[int, int] = {}  # a node of the last Draft that was fed -> its cache position

    def fork(self) -> "DraftTreeProposer":
        shared = getattr(self.backend, "backend", self.backend)  # a slot view's model, or the model itself
        return DraftTreeProposer(shared.open_slot(), self.target_vocab_size, self.token_ids,
                                 TreeSizing(self.sizing.costs, self.sizing.max_nodes))

    # -- a round -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
        self._context_len, self._offered, self._fed_at = len(context), (), {}
        if k < 1:
            return Draft(token_ids=())
        started = time.perf_counter()
        try:
            if len(self._cached) >= len(context):  # a round that failed after feeding the root: feed it again
                del self._cached[len(context) - 1 :]
                self.backend.trim(len(self._cached))
            feed = context[len(self._cached) :]  # >= 1 token: the text's last one (the root) is never cached
            root_logits = self.backend.forward(feed)[-1]  # [draft_vocab]: what follows the text
            self._cached += feed
            tree, fed, forwards = self._grow(root_logits, k, stop_confidence)
            self.sizing.time_forwards(time.perf_counter() - started, forwards)
            return self._offer(tree.tokens, tree.parents, fed, self.sizing.choose(tree, k, forwards))
        except BaseException:
            self.backend.trim(len(self._cached))  # whatever happened, nothing ahead of the text stays
            raise

    def _grow(self, root_logits: torch.Tensor, depth: int, stop_confidence: float):
        """Grow up to `depth` levels (tree_growth.grow). Returns (the tree, {fed node: cache position}, draft forwards
        run)."""
        spec: list[int] = []  # the node of each speculative cache entry, in cache order (after the text)
        forwards = [1]  # the root's
        text_len = len(self._cached)

        def expand(tree, nodes: list[int]):
            if text_len + len(spec) + len(nodes) > self.backend.max_context:
                return None
            logits = self._expand(nodes, tree.tokens, tree.parents, spec)  # [len(nodes), draft_vocab]
            spec.extend(nodes)
            forwards[0] += 1
            return self._candidates(logits)  # [len(nodes), BRANCH] each

        first = [row[0] for row in self._candidates(root_logits[None])]  # [BRANCH] each
        tree = grow(first, depth, expand, min_step=stop_confidence, sizing=self.sizing)  # (min_step: the chain's rule)
        return tree, {node: text_len + i for i, node in enumerate(spec)}, forwards[0]

    def _expand(self, nodes: list[int], tokens: list[int], parents: list[int], spec: list[int]) -> torch.Tensor:
        """One draft forward feeding `nodes` (one depth): each sees the text and its own ancestors, which earlier
        forwards left in the cache (`spec`, in cache order, right after the text's last token: the root)."""
        order = [*spec, *nodes]  # the tree in the slot after this forward, the root before it
        index = {node: i for i, node in enumerate(order)}
        layout = TreeLayout.of(tuple(-1 if parents[n] < 0 else index[parents[n]] for n in order))
        model = getattr(self.backend, "backend", self.backend)  # a slot view's model, or the model itself
        view = self.backend if model is not self.backend else model.default
        return model.forward_batch([(view, [tokens[n] for n in nodes])], trees=[layout])[0]

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
        ids = top.indices if self.token_ids is None else self.token_ids.to(top.indices.device)[top.indices]
        return top.values.cpu(), ids.cpu()

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
