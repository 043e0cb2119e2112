"""logits_to_probs against transformers' own warpers: an independent implementation of temperature, top-k and top-p,
which the distribution tests (test_sampling_e2e.py) take as their oracle."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from draftwise.config import SamplingConfig
from draftwise.sampling import logits_to_probs, sample
from stats_helpers import fit_pvalue


def transformers_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """What transformers' generate samples from, its warpers in its own order. logits: [rows, vocab]."""
    scores = TemperatureLogitsWarper(cfg.temperature)(None, logits.clone())
    if cfg.top_k:
        scores = TopKLogitsWarper(cfg.top_k)(None, scores)
    if cfg.top_p < 1.0:
        scores = TopPLogitsWarper(cfg.top_p)(None, scores)
    return scores.softmax(dim=-1)


@pytest.mark.parametrize("cfg", [
    SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7), SamplingConfig(temperature=1.6, top_k=5),
    SamplingConfig(temperature=1.0, top_p=0.5), SamplingConfig(temperature=0.7, top_k=20, top_p=0.9),
    SamplingConfig(temperature=1.3, top_k=3, top_p=0.95), SamplingConfig(temperature=0.5, top_p=0.2),
], ids=lambda cfg: f"t{cfg.temperature}-k{cfg.top_k}-p{cfg.top_p}")
def test_probabilities_are_transformers_own(cfg):
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3  # [rows, vocab]
    ours, theirs = logits_to_probs(logits, cfg), transformers_probs(logits, cfg)
    assert torch.equal(ours > 0, theirs > 0)  # the same tokens kept
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_top_p_keeps_the_token_that_crosses_the_mass_and_no_more():
    logits = torch.tensor([0.5, 0.3, 0.2]).log()  # probabilities 0.5, 0.3, 0.2
    # The first two hold 0.8: with top_p 0.75 the second crosses it and stays, the third goes.
    kept = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.75))
    assert kept.tolist() == pytest.approx([0.625, 0.375, 0])
    assert logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.45)).tolist() == pytest.approx([1, 0, 0])
    # top-k first, then top-p over what is left (renormalized): 0.5 / 0.8 = 0.625 already holds 0.6.
    kept = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=2, top_p=0.6))
    assert kept.tolist() == pytest.approx([1, 0, 0])


# --- drawing one token: the inverted cumulative sum --------------------------------------------------------

WEIGHTS = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5, 0.25])  # unnormalized, zeros among them, at both ends


def draws(sampler, n=20000, seed=0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [sampler(WEIGHTS, g) for _ in range(n)]


def test_a_drawn_token_follows_the_weights_and_never_has_weight_0():
    drawn = draws(sample)
    table = {i: float(w / WEIGHTS.sum()) for i, w in enumerate(WEIGHTS) if w > 0}
    assert not {i for i, w in enumerate(WEIGHTS) if w == 0} & set(drawn)
    assert fit_pvalue(drawn, table) > 1e-3


def test_a_sampler_that_bends_its_uniform_fails_the_same_test():
    import draftwise.sampling as sampling

    def bent(probs, g):  # u^1.1 in u's place: mass slides toward the first tokens
        cdf = probs.double().cumsum(-1)
        return sampling.invert(cdf, float(torch.rand((), dtype=torch.float64, generator=g)) ** 1.1 * float(cdf[-1]))

    table = {i: float(w / WEIGHTS.sum()) for i, w in enumerate(WEIGHTS) if w > 0}
    assert fit_pvalue(draws(bent), table) < 1e-6


def test_the_inversion_at_share_boundaries_takes_a_token_that_has_a_share():
    from draftwise.sampling import invert

    cdf = torch.tensor([0.0, 0.5, 0.5, 1.0], dtype=torch.float64)  # weights 0, 0.5, 0, 0.5
    assert [invert(cdf, at) for at in (0.0, 0.25, 0.5, 0.75)] == [1, 1, 3, 3]
    assert invert(cdf, 1.0) == 3  # u * total rounded up to the total
    assert invert(torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64), 0.5) == 1  # (a last token of weight 0)


def test_a_seeded_draw_repeats_and_weights_without_mass_are_refused():
    assert draws(sample, n=50, seed=3) == draws(sample, n=50, seed=3)
    for bad in (torch.zeros(4), torch.tensor([0.5, float("nan")]), torch.tensor([1.0, float("inf")])):
        with pytest.raises(RuntimeError, match="probabilities must be finite"):
            sample(bad, torch.Generator().manual_seed(0))


def test_argmax_ids_are_torchs_own_ties_nans_and_infinities_included():
    from draftwise.sampling import argmax_ids

    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, nan, 3.0, nan], [2.0, 5.0, 5.0, 1.0], [-inf] * 4, [inf, 1.0, inf, 0.0]])
    random = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)).round(decimals=1)  # many ties
    for logits in (rows, random, random.double(), random[:, ::3], random.bfloat16()):
        assert argmax_ids(logits) == logits.argmax(dim=-1).tolist()
