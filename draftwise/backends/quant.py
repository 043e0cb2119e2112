"""The quant backend: a transformers model whose linears run on its GGUF file's own blocks (quant_model.py), as
a backend of its own.

It runs through HFBackend's machinery (one SlotCache, ragged batches, trees, hidden states, the model's layers):
what differs is what it is and declares. It computes in float32 around its integer kernel, and it is
batch-invariant by construction (no setting gives that up). Subclassing HFBackend keeps an `isinstance(x,
HFBackend)` of code written before the backends declared their capabilities true of it."""
from __future__ import annotations

from dataclasses import replace

from transformers import PreTrainedModel

from draftwise.backends.hf import HFBackend
from draftwise.backends.quant_model import runs_on_blocks
from draftwise.errors import DraftwiseError


class QuantBackend(HFBackend):
    """model: a transformers causal LM whose linears are QuantLinear (quant_model.on_gguf_weights made it)."""

    backend_name = "quant"
    capabilities = replace(HFBackend.capabilities, batch_invariant=True, dtypes=("float32",))

    def __init__(self, model: PreTrainedModel):
        if not runs_on_blocks(model):
            raise DraftwiseError("the quant backend runs a model whose linears are on its GGUF file's blocks; "
                                 f"{type(model).__name__} has none (load it with --backend quant, or use hf)")
        super().__init__(model)
