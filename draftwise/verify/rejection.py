"""Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

For draft token x_i drawn from q_i, with the target's p_i at the same position:

- accepted: x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)); rounds stop at the first rejection.
- recovered token: at the first rejection, the next token is drawn from norm(max(0, p_i - q_i)),
  the part of p that q under-covers. Accepted-or-recovered is then distributed exactly as p_i.
- bonus token: when every draft token is kept, one more token is drawn from p_n, for free.

A one-hot guess (prompt lookup, q is None) is q_i = onehot(x_i): accept with probability p_i(x_i),
recover from p_i with x_i removed.
"""
from __future__ import annotations

import torch

from draftwise.sampling import sample
from draftwise.types import Verdict


def verify_rejection(
    draft_ids: list[int] | tuple[int, ...],
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """draft_ids: n tokens; q: [n, vocab] or None (one-hot); p: [n + 1, vocab] target probabilities."""
    n = len(draft_ids)
    # One uniform per draft position, drawn up front so the stream of random numbers is fixed per round.
    uniforms = torch.rand(n, generator=generator).tolist()
    for i, token in enumerate(draft_ids):
        p_token = float(p[i, token])
        q_token = 1.0 if q is None else float(q[i, token])
        if uniforms[i] * q_token < p_token:  # u < p/q, without dividing by a tiny q
            continue
        return Verdict(num_accepted=i, next_token=sample(_residual(p[i], q, i, token), generator))
    return Verdict(num_accepted=n, next_token=sample(p[n], generator))


def _residual(p_i: torch.Tensor, q: torch.Tensor | None, i: int, token: int) -> torch.Tensor:
    """norm(max(0, p_i - q_i)): where the target wants more mass than the draft gave."""
    if q is None:
        residual = p_i.clone()
        residual[token] = 0.0
    else:
        residual = (p_i - q[i]).clamp_min(0.0)
    total = residual.sum()
    # A rejection means p(x) < q(x), so p has mass elsewhere; rounding alone can empty it.
    return residual / total if total > 0 else p_i
