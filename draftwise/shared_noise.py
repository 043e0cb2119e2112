"""Seeded sampling by shared noise: each position of a text draws its token from noise that the seed and the
position alone decide, so that the draft can read the same noise and name the target's draw before it is made.

The target's token at text position t is the Gumbel-max draw (the exponential race):

    token_t = argmax_x  w_t(x) - log E_t(x),   E_t(x) ~ Exp(1), independent for every (seed, t, x)

where w_t are the tempered log-weights after top-k and top-p (sampling.tempered_logits). Token x's clock rings at
E_t(x) / e^w_t(x), an exponential of rate e^w_t(x); the first to ring is x with probability e^w_t(x) / sum e^w_t:
an exact draw from the target's distribution, the noise at t being independent of every other position's and of
the text before t.

Why: verification becomes a comparison, as greedy decoding's is. A draft token is kept when it is the target's own
draw at its position (verify/batch.py takes these draws as a greedy row's ids), so the text is the target's draws
whatever was drafted: a seed gives the same text with every method, any k, tree or batch, and k may follow the
measured costs (a rejection sampler's text depends on the rounds' shapes, which the timings would then move). A draft
model runs the race on the same clocks with its own weights (proposers/draft_model.py), and names the
target's token about as often as rejection sampling keeps a draft's sample: for the Qwen pair at temperature 0.7,
0.816 of positions against 0.827 (docs/experiments/shared-noise-spr).

The rule is float64 (as sample()'s cumulative sum is), so every token's chance is its probability to within float64's
rounding; a float32 copy of the noise finds the few tokens that can win, and those alone are scored in float64. A
position's noise is drawn once and kept while the rounds near it read it again.
"""
from __future__ import annotations

import numpy as np
import torch

from draftwise.config import SamplingConfig
from draftwise.sampling import tempered_logits

KEPT_POSITIONS = 32  # the positions whose noise is kept: a round reads at most k + 1 (a tree: its depth + 1) of them
# E below float32's smallest normal counts as it: the noise -log E then stays finite (at most 87.3) in both widths, so a
# token top-k or top-p dropped (-inf) never wins. A clock that rings before 2^-126 has a chance far below float64's
# rounding; it rings at 2^-126 instead.
TINY = float(np.finfo(np.float32).tiny)
_MASK64 = (1 << 64) - 1


class SharedNoise:
    """One seeded sequence's noise over the target's logits rows: per text position t, the uniforms u_t [width] that
    make its clocks E_t = -log(1 - u_t)."""

    def __init__(self, sampling: SamplingConfig, width: int):
        assert not sampling.greedy and sampling.seed is not None, "shared noise is for seeded sampling"
        self.sampling, self.width = sampling, width
        self._by_position: dict[int, tuple[np.ndarray, torch.Tensor]] = {}

    def at(self, position: int) -> tuple[np.ndarray, torch.Tensor]:
        """(u_position [width] float64 in [0, 1), the same for a seed and position on every call and in every process;
        -log E in float32, to find the tokens that can win)."""
        noise = self._by_position.get(position)
        if noise is None:
            uniform = np.random.Generator(np.random.SFC64(position_seed(self.sampling.seed, position))).random(
                self.width)
            clocks = torch.from_numpy(uniform).neg().log1p_().neg_().clamp_(min=TINY)  # E ~ Exp(1), float64
            noise = uniform, clocks.float().log_().neg_()
            self._by_position[position] = noise
            while len(self._by_position) > KEPT_POSITIONS:
                del self._by_position[min(self._by_position)]
        return noise

    def draws(self, logits: torch.Tensor, positions: list[int]) -> list[int]:
        """The token drawn at each position from its row of logits [n, vocab <= width] (n = len(positions))."""
        weights = tempered_logits(logits.detach().cpu(), self.sampling)  # [n, vocab] float32, where the noise is
        return [self._draw(row, *self.at(position)) for row, position in zip(weights, positions)]

    @staticmethod
    def _draw(weights: torch.Tensor, uniform: np.ndarray, rough: torch.Tensor) -> int:
        """argmax_x weights(x) - log E(x) in float64 (the first of equal maxima), weights [vocab] float32. In float32
        each score is within 2^-21 (|score| + 128) of its float64 value, so a token scoring below the float32 maximum
        by more than 2^-16 (|max| + 128) cannot be the float64 maximum: the tokens within that margin (most often the
        maximum alone) are scored again, in float64 from their uniforms."""
        scores = (weights + rough[: len(weights)]).numpy()  # [vocab] float32
        best = float(scores.max())
        near = np.flatnonzero(scores >= best - 2.0 ** -16 * (abs(best) + 128))
        if len(near) == 1:
            return int(near[0])
        clocks = np.maximum(-np.log1p(-uniform[near]), TINY)
        exact = weights.numpy()[near].astype(np.float64) - np.log(clocks)
        return int(near[np.argmax(exact)])


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for one position's noise: splitmix64 of (seed, position), so that neighbouring seeds and
    positions start unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1
