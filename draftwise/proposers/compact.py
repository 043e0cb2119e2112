"""A cheaper copy of a draft model: an output layer over the common tokens only, and each linear on the kernel
that measures fastest here (int8 included: a draft's values may change, only acceptance moves).

On a CPU, one decode step of a small model is bound by memory bandwidth: its time is the bytes of its
weights. Two cuts:
- the output layer is 136M of Qwen2.5-0.5B's 494M parameters (151,936 tokens x 896). Byte-level BPE numbers
  its tokens in merge order, so the low ids are the frequent ones (FR-Spec, Zhao et al. 2025, keeps the
  most frequent tokens the same way); keeping 32,768 of them plus the special tokens reads a fifth of the
  bytes, so it is never slower; what it can cost is acceptance, which the bench measures;
- int8 weights read half the bytes of bfloat16 and a quarter of float32, but whether its kernel is faster
  depends on the dtype, the shape and the CPU (several times slower than float32 on some processors, faster
  than bfloat16 on others), so backends/kernels.py times it against the alternatives at load and keeps the fastest.
A draft token outside the kept set is simply never proposed. Nothing here touches exactness: the target
still verifies every token.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from draftwise.backends.kernels import DRAFT_KERNELS, DRAFT_WIDTHS, KernelPlan, plan_kernels, with_kernels

KEEP_VOCAB = 32768
FOUR_BIT = "q4"  # a draft's linears on a 4-bit copy (backends/quant_model.on_4bit), for the quant backend


def compact_draft(model, special_ids=(), keep_vocab: int = KEEP_VOCAB, kernels=DRAFT_KERNELS,
                  cache: bool = True) -> tuple[nn.Module, torch.Tensor | None, KernelPlan]:
    """(a compact copy of model, the target id of each of its logits or None, the kernel plan it runs on).

    The original is untouched: the bench runs transformers' own assisted generation on it.
    kernels: the candidates timed for each linear (EXACT_KERNELS keeps the draft's values; one name forces it);
    (FOUR_BIT,): every linear on a 4-bit copy on qgemm.c, beside a target on the quant backend."""
    model = copy.deepcopy(model)
    token_ids = _shrink_output_layer(model, special_ids, keep_vocab)
    if tuple(kernels) == (FOUR_BIT,):
        from draftwise.backends.quant_model import on_4bit

        return on_4bit(model, progress=False).eval(), token_ids, KernelPlan({}, {}, DRAFT_WIDTHS)
    plan = plan_kernels(model, tuple(kernels), DRAFT_WIDTHS, cache=cache)
    return with_kernels(model, plan).eval(), token_ids, plan


def _shrink_output_layer(model, special_ids, keep_vocab: int) -> torch.Tensor | None:
    small, token_ids = compact_readout(model.get_output_embeddings(), special_ids, keep_vocab)
    if small is None:
        return None
    model.config.tie_word_embeddings = False  # the input embeddings keep every token
    model.set_output_embeddings(small)
    return token_ids


def target_ids(rows: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
    """Rows of a compact readout (any shape) as the target ids they stand for; token_ids None: a full readout."""
    return rows if token_ids is None else token_ids.to(rows.device)[rows]


def compact_readout(head: nn.Linear, special_ids=(), keep_vocab: int = KEEP_VOCAB
                    ) -> tuple[nn.Linear | None, torch.Tensor | None]:
    """(a copy of the output layer over the keep_vocab lowest ids and the special ones, the target id of each
    of its rows), or (None, None) when the vocabulary is no larger than that."""
    vocab = head.weight.shape[0]
    if vocab <= keep_vocab:
        return None, None
    kept = sorted(set(range(keep_vocab)) | {i for i in special_ids if 0 <= i < vocab})
    token_ids = torch.tensor(kept, dtype=torch.long, device=head.weight.device)  # [kept]
    small = nn.Linear(head.weight.shape[1], len(kept), bias=head.bias is not None,
                      device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        small.weight.copy_(head.weight[token_ids])
        if head.bias is not None:
            small.bias.copy_(head.bias[token_ids])
    return small, token_ids
