"""A transformers model whose linears run on its GGUF file's own quantized blocks (QuantLinear, qgemm.c).

The quant backend builds it from the file alone (gguf_model.load_gguf_model); on_gguf_weights swaps the linears of a
float model converted from the same file onto its blocks (the route before, kept as the reference the native model
is checked against: the same bits). Attention and the cache stay transformers' own, so every method that runs on the
transformers route (trees, layer skipping) runs here too.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
from torch import nn

from draftwise.backends.gguf_weights import Blocks, decode, pack, quantize_draft, unpack
from draftwise.backends.attention import use_row_invariant_attention
from draftwise.backends.qgemm import QuantLinear
from draftwise.backends.quant_layers import fuse_layers
from draftwise.errors import DraftwiseError
from draftwise.progress import bar

# GGUF tensor -> the module of a transformers decoder (Llama, Qwen2 and the families that share their names)
LAYER_TENSORS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
# Phi-3's fused projections: one qkv tensor, and ffn_up holding the gate's rows then the up's (gate_up_proj)
FUSED_TENSORS = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
CHECKED_ROWS = 16  # rows of each weight compared with the float model: catches a wrong name or channel order
def runs_on_blocks(model: nn.Module) -> bool:
    """Whether model's linears run on GGUF blocks (on_gguf_weights made it)."""
    return any(isinstance(module, QuantLinear) for module in model.modules())


def module_name(tensor: str, tied: bool, modules=None) -> str | None:
    """The model's module for a GGUF weight, or None for one that is not a linear (norms, embeddings); modules: the
    model's, where a fused projection (Phi-3's) is looked for when the unfused one is not there."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", tensor)
    if match:
        layer, part = match.groups()
        for table in (LAYER_TENSORS, FUSED_TENSORS):
            name = f"model.layers.{layer}.{table.get(part)}"
            if part in table and (modules is None or name in modules):
                return name
    if tensor == "output.weight" or (tied and tensor == "token_embd.weight"):
        return "lm_head"
    return None


def llama_order(rows: int, heads: int) -> np.ndarray:
    """The channel order that undoes llama.cpp's conversion of a Llama q or k projection (rotary halves
    interleaved), as transformers' GGUF loader undoes it."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)


def on_gguf_weights(model: nn.Module, gguf_path: Path, progress: bool = True) -> nn.Module:
    """Replace model's linears, in place, by QuantLinear on the blocks of gguf_path (the file the model was
    converted from); a float weight in the file (F32, F16) leaves its layer as it is."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    tied = "output.weight" not in tensors
    modules = dict(model.named_modules())
    jobs = [(t, module_name(name, tied, modules)) for name, t in tensors.items()
            if module_name(name, tied, modules) in modules]
    if not jobs:
        raise DraftwiseError(f"{gguf_path.name}: no weight in it matches a linear of the {arch} model")
    for tensor, name in bar(jobs, desc="quantized weights", disable=not progress):
        if tensor.tensor_type.name in ("F32", "F16", "BF16"):
            continue
        linear = modules[name]
        k, n = (int(size) for size in tensor.shape[:2])
        if not isinstance(linear, nn.Linear) or (linear.out_features, linear.in_features) != (n, k):
            raise DraftwiseError(f"{gguf_path.name}: {tensor.name} [{n}, {k}] does not fit the model's {name}")
        blocks = decode(tensor.tensor_type.name, tensor.data, n, k)
        blocks = _model_order(blocks, tensor.name, arch, model.config)
        _check_rows(blocks, linear, tensor.name, gguf_path.name)
        _replace(model, modules, name, QuantLinear(pack(blocks), linear.bias))
    return _on_quant_layers(model)


def _replace(model: nn.Module, modules: dict, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(modules[parent] if parent else model, child, module)


def _on_quant_layers(model: nn.Module) -> nn.Module:
    """What a model whose linears run on QuantLinear needs besides: its output layer untied, row-invariant attention
    in every layer, and the fused calls where the layer's shape allows."""
    model.config.tie_word_embeddings = False  # the output layer is its own module now; never tie it back
    use_row_invariant_attention(model)
    fuse_layers(model)
    return model


def _model_order(blocks: Blocks, tensor: str, arch: str, config) -> Blocks:
    if arch != "llama" or not re.search(r"\.attn_[qk]\.", tensor):
        return blocks
    heads = config.num_attention_heads if ".attn_q." in tensor else config.num_key_value_heads
    return blocks.rows(llama_order(len(blocks.q), heads))


def _check_rows(blocks: Blocks, linear: nn.Linear, tensor: str, file: str) -> None:
    ours = blocks.rows(np.arange(min(CHECKED_ROWS, len(blocks.q)))).dequantize()
    theirs = linear.weight[:CHECKED_ROWS].detach().float().numpy()
    if not np.allclose(ours, theirs, rtol=1e-5, atol=1e-6 * float(np.abs(theirs).max())):
        raise DraftwiseError(f"{file}: {tensor} does not hold the model's weights (the model was not converted "
                             "from this file, or its channel order is one draftwise does not know)")


def _field(reader, key: str) -> str:
    field = reader.fields.get(key)
    if field is None:
        return ""
    return bytes(field.parts[field.data[0]]).decode()


def on_4bit(model: nn.Module, progress: bool = True) -> nn.Module:
    """Replace model's linears, in place, by QuantLinear on a 4-bit copy of their float weights (quantize_draft): a
    draft's, which may change values. Widths that are not a multiple of 32 stay float."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and m.in_features % 32 == 0]
    modules = dict(model.named_modules())
    for name, linear in bar(linears, desc="4-bit draft", disable=not progress):
        blocks = quantize_draft(linear.weight.detach().float().numpy())
        _replace(model, modules, name, QuantLinear(pack(blocks), linear.bias))
    return _on_quant_layers(model)


def compact_on_blocks(model: nn.Module, special_ids=(), keep_vocab: int = 32768):
    """(a copy of a model on blocks whose output layer keeps the keep_vocab lowest ids and the special ones, the target
    id of each of its logits), as proposers/compact.py cuts a float draft's, but on the file's own blocks: the rows
    kept are the same bytes, nothing is re-quantized. (model, None) when the vocabulary is no larger. The copy
    shares every other module (the decoder holds no state of a sequence: caches are passed in); the model passed in
    is left as it is."""
    import torch

    head = model.get_output_embeddings()
    vocab = head.out_features
    if vocab <= keep_vocab or not isinstance(head, QuantLinear):
        return model, None
    kept = sorted(set(range(keep_vocab)) | {i for i in special_ids if 0 <= i < vocab})
    token_ids = torch.tensor(kept, dtype=torch.long)  # [kept]
    blocks = unpack(head.packed())
    # (on huge pages, as the head it is cut from: a draft's readout is a seventh of the bytes its forward streams)
    small = QuantLinear(pack(blocks.rows(np.array(kept))).on_huge_pages(),
                        None if head.bias is None else head.bias[token_ids])
    twin = copy.copy(model)  # (a model on blocks holds C structs: shared, never deep-copied)
    twin._modules = dict(model._modules)  # its own children: the output layer set below is the copy's alone
    twin.set_output_embeddings(small)
    return twin.eval(), token_ids
