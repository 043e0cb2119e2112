"""A model on blocks run pass by pass as one qgemm.c call over all its layers, past transformers' model forward.

Why: once each decoder layer was one qgemm.c call (quant_layers.py), what a plain step of a 1.5B model spent beside
its weight reads was mostly Python around those calls: transformers' model forward (its decorators, the mask
preparation, a module call with a dozen keyword arguments per layer), each layer's own making of what every layer of
the pass shares (rotary rows, cache places, visible keys), and the return to Python between layers, whose every
object the weights' streaming had pushed out of the caches. Here the shared parts are made once a pass and
dw_decoder_stack runs the layers back to back on two buffers: the same dw_decoder_layer calls, in the same order, on
the same values as transformers' route makes them, so the same bits (tests/test_quant_backend.py).

It runs only where that route would run every layer in one call and nothing watches the modules: each layer fused
(quant_layers.OneCallLayer, with its struct), the backend's SlotCache, one mask for every layer, no hooks (the
hidden-state capture hooks the decoder; a layer-skipping draft swaps layers, whose structs are then checked). Any
other pass takes transformers' forward, as before.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from draftwise.backends.attention import visible_keys
from draftwise.backends.qgemm import LayerStruct, library
from draftwise.backends.quant_layers import OneCallLayer, rotary_rows
from draftwise.backends.slots import SlotCache
from draftwise.errors import DraftwiseError


def runs_in_one_call(model: nn.Module) -> bool:
    """Whether any decoder layer of model is fused (quant_layers.fuse_layers): the models whose passes may run here."""
    return any(isinstance(layer, OneCallLayer) for layer in getattr(getattr(model, "model", None), "layers", ()))


def layer_structs(model: nn.Module) -> list | None:
    """Each decoder layer's (attention module, LayerStruct), or None where a pass must take transformers' forward
    (a layer not in one call, a hook on a module the loop would pass by)."""
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or _watched(model) or _watched(decoder):
        return None
    count = model.config.num_hidden_layers
    if len(layers) < count or torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return None
    structs = []
    for layer in list(layers)[:count]:
        if not isinstance(layer, OneCallLayer) or _watched(layer):
            return None
        struct = layer._one_call.struct(layer)
        if struct is None:
            return None
        structs.append((layer._modules["self_attn"], struct))
    shapes = {(attn.kv_heads, attn.head_dim) for attn, _ in structs}
    return structs if len(shapes) == 1 else None  # (every layer's cache then has the same strides)


def _watched(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


@torch.inference_mode()
def stack_logits(model: nn.Module, structs: list, input_ids: torch.Tensor, mask: torch.Tensor,
                 position_ids: torch.Tensor, cache: SlotCache, logits_to_keep: int) -> torch.Tensor:
    """The logits [B, logits_to_keep, vocab] of a pass whose cache places cache.begin_forward set: what
    model(input_ids=, attention_mask=mask, position_ids=, cache=, logits_to_keep=).logits gives, bit for bit.
    input_ids, position_ids [B, N]; mask [B, 1, N, end] (bool, or additive); structs: layer_structs(model)."""
    decoder = model.model
    hidden = decoder.embed_tokens(input_ids)  # [B, N, H]
    batch, n, width = hidden.shape
    cos, sin = rotary_rows(decoder.rotary_emb(hidden, position_ids), batch, n)  # [B * n, d] each
    cache_rows, write_at, read_end = cache.forward_places()  # [B, 1], [B, n]
    visible = visible_keys(mask, batch, n, read_end)  # [B, n, read_end]
    rows = hidden.reshape(-1, width).float().contiguous()  # [B * n, H]
    out, spare = torch.empty_like(rows), torch.empty_like(rows)  # the layers write them in turn, out last
    layers, keys, values, strides = _cache_buffers(cache, structs, rows)
    status = library().dw_decoder_stack(layers, len(structs), rows.data_ptr(), batch, n, cos.data_ptr(),
                                        sin.data_ptr(), keys, values, *strides, cache_rows.data_ptr(),
                                        write_at.data_ptr(), visible.data_ptr(), read_end, out.data_ptr(),
                                        spare.data_ptr())
    if status:
        raise DraftwiseError(f"the quant decoder layers refused a [{len(rows)}, {width}] call ({status})")
    hidden = decoder.norm(out.reshape(batch, n, width))
    kept = hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden  # (transformers' slice_logits_to_keep)
    return model.get_output_embeddings()(kept)  # [B, logits_to_keep, vocab]


def _cache_buffers(cache: SlotCache, structs: list, rows: torch.Tensor) -> tuple:
    """(the layers' structs, their cache keys and values, as C arrays; the caches' strides, alike for every layer:
    layer_structs runs only models whose layers share their heads' shape): the buffers made on a layer's first
    write, as its own call makes them."""
    attn = structs[0][0]
    like = rows.new_empty(1, attn.kv_heads, 1, attn.head_dim)  # [1, Hkv, 1, d]
    keys, values = [], []
    for attn, _ in structs:
        k, v = cache.layer_buffers(attn.layer_idx, like)  # [rows, Hkv, capacity, d] each
        if k.dtype != torch.float32:  # the C call writes float32 rows in place
            raise DraftwiseError(f"the quant decoder layer writes a float32 cache; layer {attn.layer_idx}'s holds "
                                 f"{k.dtype}")
        keys.append(k.data_ptr())
        values.append(v.data_ptr())
    count = len(structs)
    return (_struct_array([struct for _, struct in structs]), (ctypes.c_void_p * count)(*keys),
            (ctypes.c_void_p * count)(*values), k.stride()[:3])


_last_structs: list = [(), None]  # (the structs, their C array): a pass reuses the last one's while the layers stay


def _struct_array(structs: list):
    if len(structs) != len(_last_structs[0]) or any(a is not b for a, b in zip(structs, _last_structs[0])):
        _last_structs[:] = [tuple(structs), (ctypes.POINTER(LayerStruct) * len(structs))(
            *(ctypes.pointer(struct) for struct in structs))]
    return _last_structs[1]
