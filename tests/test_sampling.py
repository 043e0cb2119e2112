"""logits_to_probs against transformers' own warpers: an independent implementation of temperature, top-k and top-p,
which the distribution tests (test_sampling_e2e.py) take as their oracle."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from draftwise.config import SamplingConfig
from draftwise.sampling import logits_to_probs


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
