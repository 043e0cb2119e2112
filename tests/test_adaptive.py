"""The draft-length controller (which k pays) and the compact draft (int8, fewer output tokens).

Exactness of both through the engine is covered where every proposer is: test_greedy_identity.py and
test_sampling_e2e.py run with adaptive k on (the default) and a compact draft; here, the decisions and the
compact model's own behaviour.
"""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer

from draftwise.adaptive import PROBE_EVERY, DraftLengthController, expected_tokens
from draftwise.engine import Engine
from draftwise.backends.kernels import Int8Linear
from draftwise.proposers.compact import compact_draft


def _feed(controller, rounds, k, accepted, draft_s, verify_s):
    for _ in range(rounds):
        controller.observe(k, accepted, draft_s * k, verify_s)


def test_expected_tokens_is_leviathans():
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 4) == 5


def test_tries_the_full_width_before_anything_is_measured():
    assert DraftLengthController(k_max=6).choose() == 6


def test_always_accepted_with_flat_verification_drafts_the_most():
    c = DraftLengthController(k_max=8)
    _feed(c, 20, 8, 8, draft_s=0.01, verify_s=0.2)
    c.observe(0, 0, 0.0, 0.2)
    assert c.acceptance > 0.95
    assert c.choose() == 8


def test_never_accepted_backs_off_to_plain_steps_but_probes():
    # Lookup in float32: free guesses, but a wide verification costs two plain steps and nothing is kept.
    c = DraftLengthController(k_max=4)
    _feed(c, 10, 4, 0, draft_s=0.0, verify_s=0.9)
    c.observe(0, 0, 0.0, 0.45)
    choices = [c.choose() for _ in range(2 * PROBE_EVERY)]
    assert choices.count(0) == 2 * PROBE_EVERY - 2 and choices.count(1) == 2


def test_expensive_draft_with_middling_acceptance_drafts_few():
    # c = 0.5 and a = 0.5: one token pays (1.5 / 1.5 = 1 step per token) no better than none; wider is worse.
    c = DraftLengthController(k_max=8)
    for k in range(0, 9):
        c.observe(k, k // 2, 0.1 * k, 0.2)
    assert c.choose() <= 2


def test_stop_confidence_is_the_cost_ratio_capped():
    c = DraftLengthController(k_max=4)
    assert c.stop_confidence() == 0.0
    _feed(c, 5, 1, 1, draft_s=0.05, verify_s=0.2)
    assert c.stop_confidence() == pytest.approx(0.25, rel=0.05)
    _feed(c, 50, 1, 1, draft_s=0.5, verify_s=0.2)
    assert c.stop_confidence() == 0.5


def test_int8_linear_is_close_to_the_float_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 300, bias=True)
    x = torch.randn(3, 5, 64)
    q = Int8Linear(linear)
    assert q.weight.dtype == torch.int8 and q(x).shape == (3, 5, 300)
    assert torch.allclose(q(x), linear(x), atol=0.05 * linear(x).abs().max().item())


def test_compact_draft_keeps_the_common_tokens_and_leaves_the_original_alone():
    model = tiny_model("llama", seed=0)
    before = model.lm_head.weight.clone()
    small, token_ids, plan = compact_draft(model, special_ids=[290, 5000], keep_vocab=100, kernels=("int8",))
    assert token_ids.tolist() == list(range(100)) + [290]  # 5000 is past the vocabulary
    assert small.get_output_embeddings().out_features == 101
    assert isinstance(small.lm_head, Int8Linear) and set(plan.choices.values()) == {"int8"}
    assert torch.equal(model.lm_head.weight, before) and type(model.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("draft_vocab", [200, 100_000])
def test_compact_draft_gives_the_targets_greedy_output(draft_vocab):
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    plain = Engine.from_models(target, tokenizer, method="none").generate("The quick brown fox", max_new_tokens=24,
                                                                          ignore_eos=True)
    eng = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=0), draft_vocab=draft_vocab)
    result = eng.generate("The quick brown fox", max_new_tokens=24, ignore_eos=True, num_draft_tokens=4)
    assert result.token_ids == plain.token_ids
    assert all(t < 200 or t in tokenizer.all_special_ids for t in eng.proposer.token_ids.tolist()) \
        if draft_vocab == 200 else eng.proposer.token_ids is None
    # A twin draft, even in int8, agrees with its target on most tokens.
    assert result.stats.acceptance_rate > (0.2 if draft_vocab == 200 else 0.7)
