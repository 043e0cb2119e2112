"""A cheaper copy of a draft model: int8 weights and an output layer over the common tokens only.

On a CPU, one decode step of a small model is bound by memory bandwidth: its time is the bytes of its
weights. Two cuts, measured on Qwen2.5-0.5B in bfloat16 on 2 cores:
- int8 weights with one scale per output row (weight-only: activations stay in the model's dtype) read
  half the bytes; 48 MLP matrices took 15.6 ms instead of 25.5 ms;
- the output layer is 136M of the draft's 494M parameters (151,936 tokens x 896). Byte-level BPE numbers
  its tokens in merge order, so the low ids are the frequent ones (FR-Spec, Zhao et al. 2025, keeps the
  most frequent tokens the same way); keeping 32,768 of them plus the special tokens took the layer from
  21.5 ms to about 2 ms.
A draft token outside the kept set is simply never proposed. Nothing here touches exactness: the target
still verifies every token, so only acceptance can change, and the bench measures it.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

KEEP_VOCAB = 32768


class Int8Linear(nn.Module):
    """nn.Linear with int8 weights, one scale per output row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
        self.register_buffer("weight", (weight / scale[:, None]).round().clamp(-128, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # [tokens, in]
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scale)  # [tokens, out]
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias


def int8_available(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def compact_draft(model, special_ids=(), keep_vocab: int = KEEP_VOCAB, quantize: bool = True):
    """(a compact copy of model, the target id of each of its logits or None). The original is untouched:
    the bench runs transformers' own assisted generation on it."""
    model = copy.deepcopy(model)
    token_ids = _shrink_output_layer(model, special_ids, keep_vocab)
    if quantize and int8_available(model.device):
        _quantize_linears(model)
    return model.eval(), token_ids


def _shrink_output_layer(model, special_ids, keep_vocab: int) -> torch.Tensor | None:
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0]
    if vocab <= keep_vocab:
        return None
    kept = sorted(set(range(keep_vocab)) | {i for i in special_ids if 0 <= i < vocab})
    token_ids = torch.tensor(kept, dtype=torch.long, device=head.weight.device)  # [kept]
    small = nn.Linear(head.weight.shape[1], len(kept), bias=head.bias is not None,
                      device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        small.weight.copy_(head.weight[token_ids])
        if head.bias is not None:
            small.bias.copy_(head.bias[token_ids])
    model.config.tie_word_embeddings = False  # the input embeddings keep every token
    model.set_output_embeddings(small)
    return token_ids


def _quantize_linears(model) -> None:
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, Int8Linear(child))
