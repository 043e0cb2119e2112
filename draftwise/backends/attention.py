"""Grouped-query attention over a few new tokens without copying the cache for every query head.

Why: a model with grouped queries (Qwen2.5-1.5B: 12 query heads share 2 key/value heads) has transformers' SDPA
path `repeat_kv` the whole cached keys and values, one copy per query head, whenever more than one token is new and
a mask is given: every verification pass and every depth of a draft tree. With a long cache those copies cost
more than the pass's arithmetic, and a 2-token pass costs far more than a 1-token one. For a
single token transformers already folds a group's query heads into rows of their shared key/value head
(`pack_gqa`); grouped_sdpa does the same for any width: the query [B, H, n, d] becomes [B, Hkv, groups * n, d],
each row keeps its own mask row, and every row attends to the very keys and values it did before, and a 2-token
pass costs about what a 1-token one does.

Only for few new tokens: the mask is repeated for each group instead (groups * n * keys entries), which for n
up to the head dimension costs less than the copies it saves (2 * (groups - 1) * keys * d). A prefill's
chunks keep transformers' path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

NAME = "draftwise_grouped_sdpa"


def grouped_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature. query [B, H, n, d]; key, value [B, Hkv, keys, d];
    attention_mask [B, 1, n, keys] (bool, or additive). Returns ([B, n, H, d], None), as transformers' SDPA does."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, n, dim = query.shape
    if not _groups_rows(groups, n, dim, value.shape[-1], attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kv_heads, keys = key.shape[1], key.shape[2]
    rows = query.reshape(batch, kv_heads, groups * n, dim)  # row g * n + t: query head g of the group, token t
    # [B, 1, groups * n, keys]: row g * n + t is token t's mask row, as the query's rows are laid out
    mask = attention_mask.expand(-1, -1, n, keys).repeat(1, 1, groups, 1)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)  # [B, Hkv, groups * n, d]
    return out.reshape(batch, heads, n, dim).transpose(1, 2).contiguous(), None


def _groups_rows(groups: int, n: int, dim: int, value_dim: int, mask: torch.Tensor | None, dropout: float,
                 extra: dict) -> bool:
    """Whether grouped_sdpa folds the query heads: several tokens against shared key/value heads (values as wide
    as queries), a mask shared by every head, and none of the features (position bias, attention sinks) only
    transformers' path has."""
    shared_mask = mask is not None and mask.dim() == 4 and mask.shape[1] == 1
    plain = not dropout and all(extra.get(name) is None for name in ("position_bias", "s_aux", "sinks", "softcap"))
    return groups > 1 and 1 < n <= dim == value_dim and shared_mask and plain


AttentionInterface.register(NAME, grouped_sdpa)
AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # it takes the masks SDPA takes


def groups_queries(model) -> bool:
    """Whether use_grouped_attention would change model: an attention layer with grouped queries runs on
    transformers' SDPA."""
    return bool(_grouped_configs(model))


def use_grouped_attention(model) -> None:
    """Switch the attention layers with grouped queries that run transformers' SDPA to grouped_sdpa (the same
    values). Only those: a model whose code tests for the name "sdpa" itself (Falcon) and has no grouped queries
    must keep it."""
    for config in _grouped_configs(model):
        config._attn_implementation = NAME


def _grouped_configs(model) -> list:
    """The configs, once each, read by attention layers that group their queries and run on transformers' SDPA."""
    found = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(module, "num_key_value_groups", 1) > 1 and config is not None \
                and getattr(config, "_attn_implementation", None) == "sdpa":
            found[id(config)] = config
    return list(found.values())
