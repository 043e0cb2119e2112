"""Logits -> probabilities, applied identically to the target's p and the draft's q."""
from __future__ import annotations

import torch

from draftwise.config import SamplingConfig

# The smallest positive float32 that no CPU flushes to 0: a positive temperature or top_p below it is 0 in the float32
# arithmetic here, and is taken at its limit instead (the exact distribution for any logits a float32 can hold).
FLOAT32_TINY = torch.finfo(torch.float32).tiny


def make_generator(seed: int | None) -> torch.Generator:
    """A seeded generator makes a run repeatable; no seed draws a fresh one (torch's global RNG untouched)."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def argmax_ids(logits: torch.Tensor) -> list[int]:
    """Each row's largest logit's id, logits [rows, vocab]: the first of equal maxima, a NaN counted largest, as
    torch.argmax has it. A CPU float row goes through numpy, whose argmax reads a 152k-entry row in about 10 us where
    torch's takes about 300 us on one thread: greedy decoding's whole use of the target's logits."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order transformers uses). logits: [..., vocab]."""
    return tempered_logits(logits, cfg).softmax(dim=-1)


def tempered_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits_to_probs before its softmax: the log-weights, up to a constant per row, of the distribution sampled
    (-inf for a token top-k or top-p drop). logits: [..., vocab]."""
    logits = logits.float()
    # Shifted so the largest is 0 before dividing: a tiny temperature then sends the others to -inf, not every logit
    # to +-inf (whose softmax is NaN). The same distribution, for p and q alike.
    # (amax: the max alone, without its index, about a sixth of max(dim)'s time on a 152k row)
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    if cfg.temperature < FLOAT32_TINY:  # 0 in float32 (0 / 0 is NaN): its limit, the largest logits alike
        logits = torch.where(shifted == 0, 0.0, float("-inf"))
    else:
        logits = shifted.div_(cfg.temperature)  # (in place: shifted is this call's own)
    if 0 < cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already hold top_p of the mass; the first always stays.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # (A top_p that is 0 in float32 would drop the first too; any positive top_p keeps it and only it.)
        drop_sorted = mass_before >= max(cfg.top_p, FLOAT32_TINY)
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token id from probs [vocab] (any non-negative weights; they need not sum to 1), by inverting their
    cumulative sum at one uniform draw. Drawn on the CPU, where the generator lives, whatever the model's device.

    Why not torch.multinomial: for one draw it takes an exponential variate per entry of the vocabulary, about 5 ms
    for 152k entries on one core, more than a tenth of a small model's step; a cumulative sum is a twentieth of that.
    The sum is float64, so each token's share of [0, total) is its probability to within float64's rounding of the
    running sum (finer than multinomial's float32 arithmetic), and a token of probability 0 has no share at all."""
    cdf = probs.detach().cpu().double().cumsum(-1)  # [vocab]
    total = float(cdf[-1])
    if not 0 < total < float("inf"):  # (what multinomial refuses too: no mass, or a NaN or infinite weight)
        raise RuntimeError(f"sample: probabilities must be finite, non-negative and not all 0 (their sum is {total})")
    u = float(torch.rand((), dtype=torch.float64, generator=generator))  # [0, 1)
    return invert(cdf, u * total)


def invert(cdf: torch.Tensor, at: float) -> int:
    """The token whose share [cdf[i-1], cdf[i]) of the cumulative sum cdf [vocab] holds at (0 <= at < cdf[-1]): the
    first i with cdf[i] > at, which never has probability 0. A product u * total that rounds up to the total itself
    takes the last token that has a share."""
    i = int(torch.searchsorted(cdf, at, right=True))
    if i == len(cdf):
        i = int(torch.searchsorted(cdf, cdf[-1], right=False))  # the first index the sum reaches its end at
    return i
