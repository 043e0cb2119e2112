"""A decoder layer's parts on qgemm.c's fused calls: an RMS norm, the attention (projections, rotary embedding,
per-query attention, output projection) and the MLP, a call or two each instead of a dozen PyTorch operations.

Why: at a few rows the arithmetic of a 1.5B model's step is about 40 ms of weight reads, and PyTorch's dispatch of
the forty-odd small operations of each of its 28 layers added about 12 ms more. Each part computes a row from
that row alone, so the batch invariance of the kernel holds for the whole layer.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from draftwise.backends.attention import visible_keys
from draftwise.backends.qgemm import QuantLinear, attention, library
from draftwise.errors import DraftwiseError

ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class QuantRMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps), float32, one call."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.register_buffer("weight", norm.weight.detach().float().contiguous())
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
        cos, sin = (t.float().expand(batch, n, -1).reshape(batch * n, -1).contiguous() for t in position_embeddings)
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


def fuse_layers(model: nn.Module) -> int:
    """Put each decoder layer whose parts all run on QuantLinear (channels a multiple of 16) onto the fused calls;
    how many were. Layers of another shape keep transformers' own code, on QuantLinear still."""
    fused = 0
    for layer in getattr(getattr(model, "model", None), "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not (_fusable(attn, ATTENTION_PARTS) and _fusable(mlp, MLP_PARTS)
                and getattr(mlp, "act_fn", None).__class__.__name__ == "SiLUActivation"
                and all(hasattr(getattr(layer, name, None), "variance_epsilon")
                        for name in ("input_layernorm", "post_attention_layernorm"))):
            continue
        layer.self_attn, layer.mlp = QuantAttention(attn), QuantMLP(mlp)
        layer.input_layernorm = QuantRMSNorm(layer.input_layernorm)
        layer.post_attention_layernorm = QuantRMSNorm(layer.post_attention_layernorm)
        fused += 1
    if fused and hasattr(model.model, "norm") and hasattr(model.model.norm, "variance_epsilon"):
        model.model.norm = QuantRMSNorm(model.model.norm)
    return fused


def _fusable(module: nn.Module | None, parts: tuple[str, ...]) -> bool:
    return module is not None and all(isinstance(getattr(module, name, None), QuantLinear)
                                      and getattr(module, name).out_features % 16 == 0 for name in parts)
