"""Grouped-query attention without copies of the cache: the same values as transformers' SDPA, for a token tree and
a ragged batch, with a control that folds the mask in the wrong order and must differ."""
from __future__ import annotations

import types

import pytest
import torch
from conftest import tiny_model, transformers_greedy

from draftwise.backends import attention
from draftwise.backends.hf import HFBackend
from draftwise.backends.kernels import kernel_counts, plan_kernels, with_kernels
from draftwise.types import TreeLayout
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

TOKENS, PARENTS = (3, 1, 4, 0, 2), (-1, -1, 0, 0, 1)  # a root with two children, three grandchildren


def _random_attention(seed=0, batch=2, kv_heads=2, groups=3, n=4, keys=9, dim=8):
    """query [B, H, n, d], key and value [B, Hkv, keys, d], a bool mask [B, 1, n, keys] that differs row by row."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * groups, n, dim, generator=g)
    key, value = (torch.randn(batch, kv_heads, keys, dim, generator=g) for _ in range(2))
    mask = torch.rand(batch, 1, n, keys, generator=g) < 0.6
    mask[..., 0] = True  # every row sees at least one key
    return query, key, value, mask, types.SimpleNamespace(num_key_value_groups=groups, is_causal=True)


def _spy_folds(monkeypatch) -> list[bool]:
    """Whether each grouped_sdpa call folded its query heads, in order."""
    folded, real = [], attention._groups_rows
    monkeypatch.setattr(attention, "_groups_rows", lambda *a: folded.append(real(*a)) or folded[-1])
    return folded


@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("mask_batch", [2, 1])  # a mask per row, or one broadcast over the batch
def test_folded_query_heads_attend_as_repeated_keys_do(additive, mask_batch, monkeypatch):
    folded = _spy_folds(monkeypatch)
    query, key, value, mask, layer = _random_attention()
    mask = mask[:mask_batch]
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    ours, _ = attention.grouped_sdpa(layer, query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.3)
    assert folded == [True]
    assert ours.shape == theirs.shape == (2, 4, 6, 8)  # [B, n, H, d]
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_the_control_that_folds_the_mask_token_by_token_differs():
    """The rows are group-major (row g * n + t is token t): a mask repeated token-major pairs rows with the wrong
    token's mask. The comparison above must be able to see that."""
    query, key, value, mask, layer = _random_attention()
    batch, heads, n, dim = query.shape
    groups = layer.num_key_value_groups
    rows = query.reshape(batch, key.shape[1], groups * n, dim)
    wrong = mask.repeat_interleave(groups, dim=2)  # [B, 1, n * groups, keys], token-major
    out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=wrong, scale=0.3)
    out = out.reshape(batch, heads, n, dim).transpose(1, 2)
    theirs, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.3)
    assert not torch.allclose(out, theirs, atol=1e-3)


def test_one_token_and_no_groups_keep_transformers_path(monkeypatch):
    folded = _spy_folds(monkeypatch)
    for n, groups in ((1, 3), (4, 1)):
        query, key, value, mask, layer = _random_attention(n=n, groups=groups)
        ours, _ = attention.grouped_sdpa(layer, query, key, value, mask)
        assert torch.equal(ours, sdpa_attention_forward(layer, query, key, value, mask)[0])
    assert folded == [False, False]


def test_the_engine_copy_uses_it_and_the_model_as_loaded_does_not():
    model = tiny_model("qwen2", seed=0)  # 4 query heads over 2 key/value heads
    fast = with_kernels(model, plan_kernels(model, kernels=("dense",)))
    assert fast is not model and kernel_counts(fast) == kernel_counts(model) == {"dense": 15}
    assert fast.config._attn_implementation == attention.NAME
    assert model.config._attn_implementation == "sdpa"  # transformers' generate runs on it in the bench
    assert fast.model.embed_tokens.weight is model.model.embed_tokens.weight  # a copy of the structure only


def test_a_model_without_grouped_queries_keeps_the_name_sdpa():
    """Some model code tests for the name "sdpa" itself (Falcon): only layers that group queries are switched."""
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4)
    model = LlamaForCausalLM(config).eval()
    assert not attention.groups_queries(model)
    attention.use_grouped_attention(model)
    assert model.config._attn_implementation == "sdpa"
    assert with_kernels(model, plan_kernels(model, kernels=("dense",))) is model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_tree_and_a_ragged_batch_score_as_on_transformers_attention(arch, monkeypatch):
    model = tiny_model(arch, seed=1)
    fast = with_kernels(model, plan_kernels(model, kernels=("dense",)))
    folded = _spy_folds(monkeypatch)
    context, chain = list(range(10, 30)), [7, 8, 9]
    rows = {}
    for name, backend in (("loaded", HFBackend(model)), ("grouped", HFBackend(fast))):
        tree, other = backend.open_slot(), backend.open_slot()
        tree.prefill(context[:-1])
        other.prefill(context[:12])
        rows[name] = backend.forward_batch([(tree, [context[-1], *TOKENS]), (other, chain)],
                                           trees=[TreeLayout.of(PARENTS), None])
    assert any(folded)  # the grouped path ran (the prefills keep transformers')
    for ours, theirs in zip(rows["grouped"], rows["loaded"]):
        assert torch.allclose(ours, theirs, atol=1e-4)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("options, windows", [
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}, {None: None}),  # no layer slides
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
     {"full_attention": None, "sliding_attention": 4}),
])
def test_a_window_only_where_the_model_itself_slides(options, windows):
    # Qwen2 keeps sliding_window set when max_window_layers covers every layer, yet attends to all of its cache: a
    # window there would hide keys the model reads, past 4 tokens of text.
    from conftest import tiny_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from draftwise import Engine
    from draftwise.backends.hf import attention_windows

    tokenizer = tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, **options)
    assert attention_windows(config) == windows
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    ids = tokenizer("The quick brown fox jumps over the lazy dog and runs")["input_ids"]
    want = transformers_greedy(model, ids, 12)
    got = Engine.from_models(model, tokenizer, method="lookup").generate(ids, max_new_tokens=12, ignore_eos=True)
    assert got.token_ids == want


def test_a_short_rows_padding_stays_within_a_learned_position_table():
    # GPT-2 reads positions from a table of n_positions rows: a row near the end, padded to a wider row's width,
    # once asked for rows past it (an IndexError on the CPU; on a GPU, a device-side assert).
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=8, n_embd=32, n_layer=2, n_head=2)).eval()
    backend = HFBackend(model)
    near_end, short = backend.open_slot(), backend.open_slot()
    near_end.prefill([1, 2, 3, 4, 5, 6])
    short.prefill([7, 8])
    together = backend.forward_batch([(near_end, [9]), (short, [10, 11, 12])])
    alone = HFBackend(model)
    alone.prefill([1, 2, 3, 4, 5, 6])
    assert torch.allclose(together[0], alone.forward([9]), atol=1e-5)
    alone.prefill([7, 8])
    assert torch.allclose(together[1], alone.forward([10, 11, 12]), atol=1e-5)
