"""Seeded sampling by shared noise (shared_noise.py): each draw follows the target's distribution, and a seed gives
one text whatever the method, k, adaptivity or batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_tokenizer
from draftwise import Engine
from draftwise.config import GenerationConfig, SamplingConfig
from draftwise.sampling import logits_to_probs
from draftwise.shared_noise import KEPT_POSITIONS, TINY, SharedNoise
from stats_helpers import fit_pvalue
from test_sampling_e2e import prompt, sharpened, target

ROW = torch.tensor([2.0, 1.2, 0.7, 0.0, -0.5, -1.5, -3.0])  # one row of logits over a 7-token vocabulary
SETTINGS = [SamplingConfig(temperature=1.0, seed=3), SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, seed=3)]
DRAWS = 4000


def draws(sampling: SamplingConfig, row: torch.Tensor = ROW) -> list[int]:
    """One token at each of DRAWS positions, every one from the same row of logits."""
    noise = SharedNoise(sampling, len(row))
    return [noise.draws(row[None], [t])[0] for t in range(DRAWS)]


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1", "t0.7-topk-topp"])
def test_the_draws_follow_the_distribution_and_keep_to_its_support(sampling):
    probs = logits_to_probs(ROW, sampling)
    drawn = draws(sampling)
    assert fit_pvalue(drawn, dict(enumerate(probs.tolist()))) > 1e-3
    assert all(probs[token] > 0 for token in drawn)  # nothing top-k or top-p dropped


def test_the_same_check_rejects_draws_at_another_temperature():
    """Power: draws at temperature 0.7 are far from temperature 1's table, and noise at half its scale (a plausible
    slip: Gumbel noise against logits not divided by the temperature) fails too."""
    hot, cold = SETTINGS[0], SamplingConfig(temperature=0.7, seed=3)
    assert fit_pvalue(draws(cold), dict(enumerate(logits_to_probs(ROW, hot).tolist()))) < 1e-6
    halved = SharedNoise(hot, len(ROW))
    at = halved.at
    halved.at = lambda position: (1 - np.exp(-np.sqrt(clocks(at(position)[0]))), at(position)[1] / 2)  # -log sqrt E
    drawn = [halved.draws(ROW[None], [t])[0] for t in range(DRAWS)]
    assert fit_pvalue(drawn, dict(enumerate(logits_to_probs(ROW, hot).tolist()))) < 1e-6


def test_a_position_noise_is_the_seeds_alone():
    one, two = SharedNoise(SETTINGS[0], 100), SharedNoise(SETTINGS[0], 100)
    first = one.at(5)[0].copy()
    assert np.array_equal(first, two.at(5)[0])  # another sequence, the same seed and position
    assert not np.array_equal(first, one.at(6)[0])
    assert not np.array_equal(first, SharedNoise(SamplingConfig(temperature=1.0, seed=4), 100).at(5)[0])
    for position in range(6, 6 + 2 * KEPT_POSITIONS):  # pushes position 5 out of what is kept
        one.at(position)
    assert 5 not in one._by_position and np.array_equal(one.at(5)[0], first)  # drawn again, the same


def test_the_float32_search_finds_the_float64_maximum_even_at_near_ties():
    """Rows where a rival's float64 score is a hair above or below the leader's (far inside float32's rounding): the
    draw is always the float64 rule's, as a plain float64 argmax over the whole row gives it. Control: the float32
    maximum alone gets some of them wrong."""
    gen = np.random.default_rng(0)
    noise, wrong_in_float32 = SharedNoise(SETTINGS[0], 512), 0
    for position in range(300):
        uniform, rough = noise.at(position)
        scores = -np.log(clocks(uniform))  # [512] float64, with the weights still to come
        leader, rival = gen.choice(512, 2, replace=False)
        weights = gen.normal(0.0, 2.0, 512).astype(np.float32)
        # the rival's weight set so that its float64 score lands within +-1e-9 of the leader's
        gap = (float(weights[leader]) + scores[leader]) - scores[rival] + gen.uniform(-1e-9, 1e-9)
        weights[rival] = np.float32(gap)
        row = torch.from_numpy(weights)
        expected = int(np.argmax(weights.astype(np.float64) + scores))
        assert SharedNoise._draw(row, uniform, rough) == expected, position
        wrong_in_float32 += int(np.argmax(weights + rough.numpy())) != expected
    assert wrong_in_float32 > 0


def clocks(uniform: np.ndarray) -> np.ndarray:
    """E = -log(1 - u), as shared_noise makes its clocks."""
    return np.maximum(-np.log1p(-uniform), TINY)


def draft_engine(method: str) -> Engine:
    # A draft that is the target at another temperature: it agrees often but not always (test_sampling_e2e's).
    draft = sharpened(1.5) if method != "none" and "lookup" not in method else None
    return Engine.from_models(target(), tiny_tokenizer(), draft_model=draft, method=method)


METHODS = ["none", "draft", "lookup", "hybrid", "draft-tree", "hybrid-tree", "lookup-tree"]


@pytest.fixture(scope="module")
def texts() -> dict:
    """Each method's text for seeds 0-3 at k 1 and 3, adaptive and not, and the draft tokens it kept."""
    out = {}
    for method in METHODS:
        eng = draft_engine(method)
        for k in (1, 3):
            for adaptive in (True, False):
                for seed in range(4):
                    result = eng.generate(prompt("mid-loop"), max_new_tokens=24, temperature=1.0, top_k=20, seed=seed,
                                          num_draft_tokens=k, adaptive=adaptive, ignore_eos=True)
                    out[method, k, adaptive, seed] = (result.token_ids, result.stats.accepted)
    return out


def test_a_seed_gives_one_text_with_every_method_k_and_adaptivity(texts):
    for (method, k, adaptive, seed), (ids, _) in texts.items():
        assert ids == texts["none", 1, True, seed][0], (method, k, adaptive, seed)
    assert len({tuple(texts["none", 1, True, seed][0]) for seed in range(4)}) == 4  # the seed matters
    for method in METHODS[1:]:  # guesses were kept, so the rounds differed from none's
        assert sum(texts[method, 3, False, seed][1] for seed in range(4)) > 8, method


def test_rows_that_read_another_positions_noise_give_another_text(monkeypatch):
    """Power: were every row of a pass to draw with the noise of its first position, a drafted text would part
    from none's (none's one-row passes cannot tell)."""
    monkeypatch.setattr("draftwise.round.row_positions", lambda seq, draft: [len(seq.context)] * (len(draft) + 1))
    options = dict(max_new_tokens=24, temperature=1.0, top_k=20, num_draft_tokens=3, adaptive=False, ignore_eos=True)
    none, draft = draft_engine("none"), draft_engine("draft")
    parted = [none.generate(prompt("mid-loop"), seed=seed, **options).token_ids !=
              draft.generate(prompt("mid-loop"), seed=seed, **options).token_ids for seed in range(4)]
    assert any(parted)


def test_a_seeded_sampled_sequence_drafts_an_adaptive_k():
    eng = draft_engine("draft")
    seeded = eng.open_sequence(prompt("loop"), GenerationConfig.from_options(max_new_tokens=8, temperature=1.0, seed=1))
    assert seeded.acceptance is not None and seeded.noise is not None
    eng.close_sequence(seeded)
    unseeded = eng.open_sequence(prompt("loop"), GenerationConfig.from_options(max_new_tokens=8, temperature=1.0))
    assert unseeded.acceptance is not None and unseeded.noise is None  # rejection sampling, as before
    eng.close_sequence(unseeded)
