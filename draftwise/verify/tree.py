"""Token trees: several candidates per position, scored in one target pass, verified exactly.

A tree is plain data: Draft.token_ids[i] is node i's token and Draft.parents[i] its parent node (-1: the root,
the text's last token, which the pass feeds first); a parent comes before its children. TreeLayout (types.py)
turns it once into what the pass and the verifier need. Pass position 0 is the root, position i + 1 is node i.

Greedy: from the root, follow the child whose token is the target's argmax there; stop where none is. The
kept path is exactly the target's own greedy text.

Sampling: at each node, its children are tried in order as one-hot guesses (SpecInfer's multi-candidate rule
with q = onehot): child x is kept with probability r(x), where r starts as the target's p at that node and
loses each rejected guess (r(x) = 0, renormalized); when every child is rejected the next token is drawn from
what is left of r. Whatever is emitted at a node is distributed exactly as p there: the first guess is emitted
with probability p(x1); given it was not, the rest is p without x1, renormalized, and so on. A kept child's own
row of logits saw exactly the path to it (the tree mask), so the next step is p conditioned on that path.
The candidates must not depend on the target's random draws (they do not: proposers build them first).
"""
from __future__ import annotations

import torch

from draftwise.sampling import sample
from draftwise.types import TreeLayout, Verdict, follow


def verify_tree_greedy(token_ids: tuple[int, ...], layout: TreeLayout, target_ids: list[int]) -> Verdict:
    """target_ids: the target's argmax at every pass position ([n + 1])."""
    path, at = follow(token_ids, layout, lambda at, _: target_ids[at])
    return Verdict(num_accepted=len(path), next_token=target_ids[at], path=tuple(path))


def verify_tree_sampled(token_ids: tuple[int, ...], layout: TreeLayout, p: torch.Tensor,
                        generator: torch.Generator) -> Verdict:
    """p: [n + 1, vocab] the target's probabilities at every pass position."""
    at, path = 0, []
    while True:
        kids = layout.children[at]
        uniforms = torch.rand(len(kids), generator=generator).tolist()  # one per guess, drawn up front
        left = p[at]
        for u, child in zip(uniforms, kids):
            token = token_ids[child - 1]
            if u < float(left[token]):
                path.append(child - 1)
                at = child
                break
            left = _without(left, token)
        else:
            return Verdict(num_accepted=len(path), next_token=sample(left, generator), path=tuple(path))


def _without(r: torch.Tensor, token: int) -> torch.Tensor:
    """r with token's mass removed, renormalized (r itself when nothing else is left, which rounding alone does)."""
    rest = r.clone()
    rest[token] = 0.0
    total = rest.sum()
    return rest / total if total > 0 else r
