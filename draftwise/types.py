"""Data that flows between the layers: drafts, verdicts, stream events."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from draftwise.metrics import Stats


@dataclass(frozen=True)
class Draft:
    """What a proposer guesses for the next positions.

    A chain: token_ids[i] is the guess for position i after the context. q[i] is the distribution it was
    drawn from, [n, vocab]; q is None for a one-hot guess (prompt lookup) or in greedy mode.

    A tree (parents set): token_ids[i] is node i's token and parents[i] its parent node, -1 for the root (the
    text's last token); parents come before children. Its guesses are one-hot (see verify/tree.py).
    """

    token_ids: tuple[int, ...]
    q: torch.Tensor | None = None  # [n, vocab] float32, or None for one-hot guesses
    parents: tuple[int, ...] | None = None  # a tree's shape; None for a chain
    forced: int = 0  # a chain's last `forced` tokens are what a grammar forces after the proposer's (grammar.py)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def own(self) -> int:
        """The proposer's own tokens: all but a grammar's forced tail."""
        return len(self.token_ids) - self.forced

    @cached_property
    def layout(self) -> TreeLayout | None:
        """A tree's TreeLayout, made once for the pass and the verifier; None for a chain."""
        return None if self.parents is None else TreeLayout.of(self.parents)

    @property
    def depth(self) -> int:
        """Positions past the context the draft reaches: its length for a chain, its deepest node for a tree."""
        return len(self.token_ids) if self.layout is None else self.layout.max_depth

    def prefix(self, n: int) -> "Draft":
        """The first n tokens (a tree's nodes come parents first, so its first n are a tree too)."""
        if n >= len(self):
            return self
        parents = None if self.parents is None else self.parents[:n]
        forced = max(0, self.forced - (len(self) - n))
        return Draft(self.token_ids[:n], None if self.q is None else self.q[:n], parents, forced)

    def extended(self, forced: list[int]) -> "Draft":
        """A chain with a grammar's forced tokens after it: one-hot guesses (q rows of one-hot where q is kept)."""
        if not forced:
            return self
        q = self.q
        if q is not None:
            q = torch.cat([q, torch.nn.functional.one_hot(torch.tensor(forced), q.shape[-1]).to(q.dtype)])
        return Draft(self.token_ids + tuple(forced), q, None, self.forced + len(forced))

    def as_chain(self, verdict: "Verdict") -> tuple[int, ...]:
        """The guesses along the verdict's path: a chain's tokens; for a tree its kept path, then the first
        child where the path stopped (the tree's leading guess there), as a chain would have offered them."""
        if self.parents is None:
            return self.token_ids
        last = verdict.path[-1] if verdict.path else -1
        after = next((node for node, parent in enumerate(self.parents) if parent == last), None)
        return tuple(self.accepted(verdict)) + (() if after is None else (self.token_ids[after],))

    def accepted(self, verdict: "Verdict") -> list[int]:
        """The draft tokens the verdict keeps, in text order."""
        if verdict.path is not None:
            return [self.token_ids[node] for node in verdict.path]
        return list(self.token_ids[: verdict.num_accepted])


@dataclass(frozen=True)
class TreeLayout:
    """A tree's shape as the target's pass and the tree verifier read it. Pass position 0 is the root (the text's
    last token), position i + 1 is node i."""

    depth: tuple[int, ...]  # per pass position: 0 for the root, 1 for its children, ...
    children: tuple[tuple[int, ...], ...]  # per pass position: its children's pass positions, in draft order
    visible: torch.Tensor  # [n + 1, n + 1] bool: position j attends to position i (i an ancestor of j, or j)

    @classmethod
    def of(cls, parents: tuple[int, ...]) -> "TreeLayout":
        n = len(parents)
        depth = [0] * (n + 1)
        children: list[list[int]] = [[] for _ in range(n + 1)]
        visible = torch.eye(n + 1, dtype=torch.bool)  # [n + 1, n + 1]
        for node, parent in enumerate(parents):
            if not -1 <= parent < node:
                raise ValueError(f"tree node {node} has parent {parent}; a parent comes before its child (-1: root)")
            at, up = node + 1, parent + 1
            depth[at] = depth[up] + 1
            children[up].append(at)
            visible[at] = visible[up]
            visible[at, at] = True
        return cls(tuple(depth), tuple(map(tuple, children)), visible)

    @property
    def max_depth(self) -> int:
        return max(self.depth)


def follow(token_ids: tuple[int, ...], layout: TreeLayout, wanted) -> tuple[list[int], int]:
    """Walk from the root down the child whose token is wanted(pass position, depth) (None: stop there). Returns
    (the nodes walked, the pass position where the walk stopped)."""
    at, path = 0, []
    while True:
        want = wanted(at, len(path))
        child = next((c for c in layout.children[at] if token_ids[c - 1] == want), None)
        if child is None:
            return path, at
        path.append(child - 1)
        at = child


def chain_parents(n: int) -> tuple[int, ...]:
    """A chain of n tokens as a tree: each node's parent is the one before it."""
    return tuple(range(-1, n - 1))


@dataclass(frozen=True)
class Verdict:
    """The verifier's answer: how many draft tokens to keep, and the target's next token."""

    num_accepted: int
    next_token: int  # recovered (after a rejection) or bonus (after full acceptance)
    path: tuple[int, ...] | None = None  # for a tree: the kept nodes, root's child first


@dataclass(frozen=True)
class Event:
    """One step of `Engine.stream`: a token, the text it completed, and where it came from.

    A token's event carries the text that became safe to show with it (text held back for a
    possible stop string or an unfinished character comes later; the last token's event flushes
    it). After the last token, one more event with token_id None carries the finish reason
    ("eos", "stop", "length"; in the server also "cancelled" and "error") and the run's stats.
    """

    token_id: int | None
    text: str
    from_draft: bool = False
    finish_reason: str | None = None
    stats: Stats | None = None  # on the last event
    error: str | None = None  # on the last event when finish_reason is "error": what went wrong


def common_prefix(a, b) -> int:
    """How many tokens two token sequences share from their start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
