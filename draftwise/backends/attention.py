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

row_invariant_attention is the other function here: a query's output computed from that query alone, whatever
else the pass holds (see its docstring); a batch-invariant model runs it in every layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from draftwise.errors import DraftwiseError

NAME = "draftwise_grouped_sdpa"
ROW_INVARIANT = "draftwise_row_invariant"


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


def row_invariant_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature, on qgemm.c's per-query attention (float32 inside, the result
    rounded to the query's dtype). Why: SDPA's result for a query changes in its last bits with the shape of the
    call (how many queries the pass holds, how many keys lie beyond the query's reach), and in bfloat16, or
    before the quant backend's int8 rounding of activations, those bits can change a token: a verification pass
    would then disagree with plain decoding. Here each query runs the same fixed-order loop over the keys it sees.
    query [B, H, n, d]; key, value [B, Hkv, L, d]; attention_mask [B, 1, n, L] (bool, or additive with the dtype's
    minimum where hidden); returns ([B, n, H, d], None)."""
    from draftwise.backends.qgemm import attention  # (deferred: it compiles the kernel library on first use)

    if dropout or any(kwargs.get(name) is not None for name in ("position_bias", "s_aux", "sinks", "softcap")):
        raise DraftwiseError("batch-invariant attention has no dropout, position bias, sinks or soft cap; "
                             "load the model with batch_invariant=False (--no-batch-invariant)")
    batch, _, n, dim = query.shape
    visible = visible_keys(attention_mask, batch, n, key.shape[2])
    scale = dim ** -0.5 if scaling is None else scaling
    out = attention(query.float(), key.float(), value.float(), visible, scale)
    return out.to(query.dtype), None


AttentionInterface.register(ROW_INVARIANT, row_invariant_attention)
AttentionMaskInterface.register(ROW_INVARIANT, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # the masks SDPA takes


def use_row_invariant_attention(model) -> None:
    """Every attention layer of model on row_invariant_attention (its config says which function it calls)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = ROW_INVARIANT


_last_mask: list = [None, None]  # (transformers' mask, its visible keys): every layer of a pass gets the same one


def visible_keys(mask: torch.Tensor | None, batch: int, n: int, keys: int) -> torch.Tensor:
    """[B, n, L] uint8: which keys each query sees, from transformers' mask [B, 1, n, L] (bool, or additive with
    the dtype's minimum where hidden); causal over the last n positions when there is none. Made once a pass."""
    if mask is not None and _last_mask[0] is mask:
        return _last_mask[1]
    if mask is None:
        seen = torch.ones(n, keys, dtype=torch.bool).tril(keys - n).expand(batch, n, keys)
    elif mask.dtype == torch.bool:
        seen = mask[:, 0].expand(batch, n, keys)
    else:
        seen = mask[:, 0] > torch.finfo(mask.dtype).min / 2
    seen = seen.expand(batch, n, keys).to(torch.uint8).contiguous()
    _last_mask[:] = [mask, seen]
    return seen
