"""Self-speculation by layer skipping: the target drafts with some of its own decoder layers passed over
(SWIFT, Xia et al. 2025) and verifies with all of them. No second model, no training, any causal LM whose
decoder keeps its layers in a list (Llama, Qwen2, Mistral and their kin).

Cache: the draft shares its sequence's own slot of the target's cache, so it needs no prefill of its own.
A draft forward writes keys and values at the draft positions only for the layers it runs (computed from
the shallower stack's hidden states, so not the full model's) and nothing for the skipped ones; settle()
trims the slot back to the text, and the verification pass that follows writes every layer at those
positions afresh. Before the draft positions the slot holds the full model's entries, which the running
layers read as they are: the draft attends to the target's own cache of the context.

Which layers to skip is calibration's choice (skip_calibration.py).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from draftwise.backends.hf import HFBackend, SlotView
from draftwise.errors import DraftwiseError
from draftwise.proposers.draft_model import DraftModelProposer


class _PassThrough(nn.Module):
    """A skipped decoder layer: its input is its output (the residual stream goes on unchanged)."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers, or a DraftwiseError that says which models have one."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) < 2:
        raise DraftwiseError(f"method 'skip' needs a decoder that keeps two or more layers in a list "
                             f"(Llama, Qwen2, Mistral-style); {type(model).__name__} has none")
    return layers


@contextmanager
def skipping(model: nn.Module, skip: tuple[int, ...]):
    """Within the block, the model runs without the layers in `skip` (the same weights, nothing copied)."""
    layers = decoder_layers(model)
    saved = {i: layers[i] for i in skip}
    passing = _PassThrough()
    for i in skip:
        layers[i] = passing
    try:
        yield
    finally:
        for i, layer in saved.items():
            layers[i] = layer


class SkippingBackend:
    """The target's backend seen as a draft model: every forward passes over the layers in `skip`."""

    def __init__(self, target: HFBackend, skip: tuple[int, ...]):
        count = len(decoder_layers(target.model))
        if not skip or any(not 0 <= i < count for i in skip) or len(set(skip)) != len(skip) or len(skip) >= count:
            raise DraftwiseError(f"layers to skip must be distinct, between 0 and {count - 1}, and leave at "
                                 f"least one; got {list(skip)}")
        self.target = target
        self.skip = tuple(sorted(skip))

    vocab_size = property(lambda self: self.target.vocab_size)
    max_context = property(lambda self: self.target.max_context)
    device = property(lambda self: self.target.device)
    dtype = property(lambda self: self.target.dtype)

    def forward_batch(self, rows: list[tuple[SlotView, list[int]]], logits: bool = True) -> list[torch.Tensor]:
        with skipping(self.target.model, self.skip):
            return self.target.forward_batch(rows, logits=logits)

    def view(self, target_slot: SlotView) -> SlotView:
        """The draft's view of one sequence: that sequence's own slot of the target's cache."""
        return SlotView(self, target_slot.slot)


class LayerSkipProposer(DraftModelProposer):
    """The draft model's round, drafted by the target with layers skipped, in the sequence's target slot.

    The slot holds the text but its last token (the engine's cache rule) at the start of a round, and must
    hold exactly that again at its end: the round feeds the last token and each draft token but the last,
    then settle() trims back; the verification pass appends the same positions with every layer."""

    def __init__(self, skipping_backend: SkippingBackend, target_vocab_size: int):
        super().__init__(backend=None, target_vocab_size=target_vocab_size)
        self.skipping = skipping_backend

    def bind(self, target_slot: SlotView) -> None:
        """Draft in this sequence's slot (called when the sequence opens, before begin)."""
        self.backend = self.skipping.view(target_slot)

    def begin(self, prompt_ids, sampling, generator) -> None:
        if self.backend is None:
            raise DraftwiseError("a layer-skip proposer drafts in its sequence's target slot; bind() it first")
        self._sampling, self._generator = sampling, generator  # the slot is the target's: nothing to reset

    def extend(self, token_ids: list[int]) -> None:
        """Nothing to prefill: the target's own prefill fills the cache the draft reads."""

    def behind(self, context: list[int]) -> int:
        """Never: the draft's cache is the target slot, which always holds the text."""
        return 0

    def restore(self, token_ids: list[int]) -> int:
        """Nothing to restore: the prompt cache restored the target slot, which is the draft's cache."""
        return len(token_ids)

    def remember(self) -> None:
        """The target slot is offered to the prompt cache by the engine."""

    def start(self, context: list[int], k: int, stop_confidence: float = 0.0) -> None:
        self._cached = list(context[:-1])  # what the target slot holds
        super().start(context, k, stop_confidence)

    def settle(self) -> None:
        self._feed = None
        self.backend.trim(self._context_len - 1)  # the verification rewrites the draft positions, every layer

    def observe(self, num_accepted: int) -> None:
        """The engine trims the target slot to the accepted text; the draft keeps nothing of its own."""

    def fork(self) -> "LayerSkipProposer":
        return LayerSkipProposer(self.skipping, self.target_vocab_size)

    def release(self) -> None:
        """The slot is the sequence's target slot: the engine frees it."""
