"""A decoder layer on qgemm.c's fused calls: one call for the whole layer (norms, projections, rotary embedding,
the cache write, per-query attention, MLP, residuals) when the cache is the backend's SlotCache, else its parts
one by one (an RMS norm, the attention, the MLP: a call or two each), with the same bits either way.

Why: at a few rows the arithmetic of a 1.5B model's step is about 40 ms of weight reads, and PyTorch's dispatch of
the forty-odd small operations of each of its 28 layers added about 12 ms more; calling the parts one by one from
Python still cost about a fifth of a step. Each part computes a row from that row alone, so the batch invariance of
the kernel holds for the whole layer.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
from torch import nn

from draftwise.backends.attention import visible_keys
from draftwise.backends.qgemm import LayerStruct, QuantLinear, attention, library
from draftwise.backends.slots import SlotCache
from draftwise.errors import DraftwiseError

ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
PRE_NORM_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")  # a layer's children, all of them


_last_rotary: list = [None, None]  # (transformers' cos table, the tables as rows): every layer of a pass gets the same


def rotary_rows(position_embeddings: tuple[torch.Tensor, torch.Tensor], batch: int,
                n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables (cos, sin [B, n, d] or [1, n, d]) as float32 rows [B * n, d], contiguous for the C calls.
    Made once a pass: the model hands every layer the same tables."""
    cos = position_embeddings[0]
    # (holding cos keeps its identity from being reused by another tensor)
    if _last_rotary[0] is not cos or len(_last_rotary[1][0]) != batch * n:
        rows = tuple(t.float().expand(batch, n, -1).reshape(batch * n, -1).contiguous() for t in position_embeddings)
        _last_rotary[:] = [cos, rows]
    return _last_rotary[1]


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class QuantRMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps), float32, one call."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        # a parameter, as the norm's own was: a model on blocks keeps float parameters (its dtype and device)
        self.weight = nn.Parameter(norm.weight.detach().float().contiguous(), requires_grad=False)
        self.eps = float(norm.variance_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()  # [tokens, hidden]
        out = torch.empty_like(rows)
        library().dw_rmsnorm(rows.data_ptr(), len(rows), rows.shape[1], self.weight.data_ptr(), self.eps,
                             out.data_ptr())
        return out.reshape(x.shape)


class QuantMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) in one call."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        for name in MLP_PARTS:
            setattr(self, name, getattr(mlp, name))
        self.hidden = mlp.down_proj.out_features
        self._structs = [getattr(self, name).struct() for name in MLP_PARTS]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.hidden).float().contiguous()  # [tokens, hidden]
        out = torch.empty_like(rows)
        gate, up, down = (ctypes.byref(s) for s in self._structs)
        status = library().dw_mlp(rows.data_ptr(), len(rows), gate, up, down, out.data_ptr())
        if status:
            raise DraftwiseError(f"the quant MLP refused a [{len(rows)}, {self.hidden}] call ({status})")
        return out.reshape(x.shape)


class QuantAttention(nn.Module):
    """A Llama/Qwen2 attention layer: q, k, v with biases and rotary embedding in one call, the cache written
    as transformers' layer writes it, then qgemm.c's per-query attention and the output projection."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        for name in ATTENTION_PARTS:
            setattr(self, name, getattr(attn, name))
        self.layer_idx, self.head_dim, self.scaling = attn.layer_idx, attn.head_dim, attn.scaling
        self.heads = attn.q_proj.out_features // self.head_dim
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.config = attn.config
        self.num_key_value_groups = self.heads // self.kv_heads
        self._structs = [getattr(self, name).struct() for name in ATTENTION_PARTS[:3]]
        self._biases = [getattr(self, name).bias for name in ATTENTION_PARTS[:3]]

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache=None, past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        batch, n, hidden = hidden_states.shape
        rows = hidden_states.reshape(-1, hidden).float().contiguous()  # [B * n, hidden]
        cos, sin = rotary_rows(position_embeddings, batch, n)  # [B * n, d] each
        q = torch.empty(batch, n, self.heads, self.head_dim)
        k = torch.empty(batch, n, self.kv_heads, self.head_dim)
        v = torch.empty_like(k)
        status = library().dw_qkv(rows.data_ptr(), len(rows), *(ctypes.byref(s) for s in self._structs),
                                  *map(_pointer, self._biases), cos.data_ptr(), sin.data_ptr(), self.head_dim,
                                  q.data_ptr(), k.data_ptr(), v.data_ptr())
        if status:
            raise DraftwiseError(f"the quant attention refused a [{len(rows)}, {hidden}] call ({status})")
        keys, values = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, n, d]
        if cache is not None:
            keys, values = cache.update(keys, values, self.layer_idx)  # [B, Hkv, L, d]
        out = attention(q.transpose(1, 2), keys.float(), values.float(), visible_keys(attention_mask, batch, n,
                                                                                      keys.shape[2]), self.scaling)
        return self.o_proj(out.reshape(batch, n, -1)), None


class OneCallLayer:
    """Mixed into a fused decoder layer's class (Llama's, Qwen2's: x + attn(norm(x)), then that + mlp(norm(that))):
    the whole layer in one call while the cache is the backend's SlotCache and the parts are the ones the call was
    built from (layer skipping swaps parts in copies); the model's own forward over the parts otherwise. The layer
    stays an instance of its model's class, which transformers looks for to record hidden states."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not args and isinstance(cache, SlotCache) and kwargs.get("position_embeddings") is not None:
            layer = self._one_call.struct(self)
            if layer is not None:
                return self._in_one_call(layer, hidden_states, kwargs.get("attention_mask"),
                                         kwargs["position_embeddings"], cache)
        return super().forward(hidden_states, *args, **kwargs)

    def _in_one_call(self, layer: LayerStruct, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_embeddings: tuple[torch.Tensor, torch.Tensor], cache: SlotCache) -> torch.Tensor:
        attn = self.self_attn
        batch, n, hidden = hidden_states.shape
        rows = hidden_states.reshape(-1, hidden).float().contiguous()  # [B * n, hidden]
        cos, sin = rotary_rows(position_embeddings, batch, n)  # [B * n, d] each
        keys, values = cache.layer_buffers(attn.layer_idx, rows.new_empty(1, attn.kv_heads, 1, attn.head_dim))
        if keys.dtype != torch.float32:  # the C call writes float32 rows in place
            raise DraftwiseError(f"the quant decoder layer writes a float32 cache; layer {attn.layer_idx}'s holds "
                                 f"{keys.dtype}")
        cache_rows, write_at, read_end = cache.forward_places()  # [B, 1], [B, n]
        visible = visible_keys(attention_mask, batch, n, read_end)  # [B, n, read_end]
        out = torch.empty_like(rows)
        status = library().dw_decoder_layer(ctypes.byref(layer), rows.data_ptr(), batch, n, cos.data_ptr(),
                                            sin.data_ptr(), keys.data_ptr(), values.data_ptr(), *keys.stride()[:3],
                                            cache_rows.data_ptr(), write_at.data_ptr(), visible.data_ptr(), read_end,
                                            out.data_ptr())
        if status:
            raise DraftwiseError(f"the quant decoder layer refused a [{len(rows)}, {hidden}] call ({status})")
        return out.reshape(batch, n, hidden)


@lru_cache(maxsize=None)
def one_call_class(layer_class: type) -> type:
    """layer_class with OneCallLayer's forward in front."""
    return type(f"OneCall{layer_class.__name__}", (OneCallLayer, layer_class), {})


class _OneCall:
    """A layer's LayerStruct, built on first use from its parts and rebuilt if a part is swapped. A copy of the
    layer (copy.deepcopy) starts empty: a struct holds raw pointers to the buffers of the parts it was built from."""

    def __init__(self):
        self._parts: tuple = ()
        self._struct: LayerStruct | None = None
        self._keep: list = []  # the WeightStructs the struct points to

    def __deepcopy__(self, memo) -> "_OneCall":
        return _OneCall()

    def struct(self, layer: nn.Module) -> LayerStruct | None:
        parts = _parts(layer)
        if parts == self._parts:  # (modules compare by identity)
            return self._struct
        attn, mlp = layer.self_attn, layer.mlp
        self._parts, self._struct, self._keep = parts, None, []
        if not (isinstance(attn, QuantAttention) and isinstance(mlp, QuantMLP)
                and all(isinstance(norm, QuantRMSNorm) for norm in parts[:3:2])
                and _fusable(attn, ATTENTION_PARTS) and _fusable(mlp, MLP_PARTS)):
            return None
        weights = [getattr(attn, name).struct() for name in ATTENTION_PARTS]
        weights += [getattr(mlp, name).struct() for name in MLP_PARTS]
        biases = [_pointer(getattr(attn, name).bias) for name in ATTENTION_PARTS[:3]]
        self._keep = weights
        self._struct = LayerStruct(*(ctypes.pointer(w) for w in weights), *biases,
                                   layer.input_layernorm.weight.data_ptr(),
                                   layer.post_attention_layernorm.weight.data_ptr(), layer.input_layernorm.eps,
                                   layer.post_attention_layernorm.eps, attn.scaling, attn.heads, attn.kv_heads,
                                   attn.head_dim)
        return self._struct


def _parts(layer: nn.Module) -> tuple:
    """The modules a layer's struct is built from, read from the modules' own tables: a pass checks them for every
    layer, and nn.Module's attribute lookup costs about a microsecond each."""
    children = layer._modules
    attn, mlp = children["self_attn"], children["mlp"]
    a, m = attn._modules.get, mlp._modules.get  # (spelled out: a generator costs more than the lookups)
    return (children["input_layernorm"], attn, children["post_attention_layernorm"], mlp, a("q_proj"), a("k_proj"),
            a("v_proj"), a("o_proj"), m("gate_proj"), m("up_proj"), m("down_proj"))


def fuse_layers(model: nn.Module) -> int:
    """Put each decoder layer whose parts all run on QuantLinear (channels a multiple of 16) onto the fused calls;
    how many were. Layers of another shape keep transformers' own code, on QuantLinear still."""
    fused = 0
    for layer in getattr(getattr(model, "model", None), "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not (_fusable(attn, ATTENTION_PARTS) and _fusable(mlp, MLP_PARTS)
                and getattr(mlp, "act_fn", None).__class__.__name__ == "SiLUActivation"
                and all(hasattr(getattr(layer, name, None), "variance_epsilon")
                        for name in ("input_layernorm", "post_attention_layernorm"))
                and {name for name, _ in layer.named_children()} == set(PRE_NORM_PARTS)
                and not any(name in dict(attn.named_children()) for name in ("q_norm", "k_norm"))):
            continue
        layer.self_attn, layer.mlp = QuantAttention(attn), QuantMLP(mlp)
        layer.input_layernorm = QuantRMSNorm(layer.input_layernorm)
        layer.post_attention_layernorm = QuantRMSNorm(layer.post_attention_layernorm)
        layer.__class__ = one_call_class(type(layer))
        layer._one_call = _OneCall()
        fused += 1
    if fused and hasattr(model.model, "norm") and hasattr(model.model.norm, "variance_epsilon"):
        model.model.norm = QuantRMSNorm(model.model.norm)
    return fused


def _fusable(module: nn.Module | None, parts: tuple[str, ...]) -> bool:
    return module is not None and all(isinstance(getattr(module, name, None), QuantLinear)
                                      and getattr(module, name).out_features % 16 == 0 for name in parts)
