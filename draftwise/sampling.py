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


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order transformers uses). logits: [..., vocab]."""
    logits = logits.float()
    # Shifted so the largest is 0 before dividing: a tiny temperature then sends the others to -inf, not every logit
    # to +-inf (whose softmax is NaN). The same distribution, for p and q alike.
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    if cfg.temperature < FLOAT32_TINY:  # 0 in float32 (0 / 0 is NaN): its limit, the largest logits alike
        logits = torch.where(shifted == 0, 0.0, float("-inf"))
    else:
        logits = shifted / cfg.temperature
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
    return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token id from probs [vocab]. Drawn on the CPU, where the generator lives, whatever the model's device."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
