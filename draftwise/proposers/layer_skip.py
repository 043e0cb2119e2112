"""Self-speculation by layer skipping: the target drafts with some of its own decoder layers passed over
(SWIFT, Xia et al. 2025) and verifies with all of them. No second model, no training, any causal LM whose
decoder keeps its layers in a list (Llama, Qwen2, Mistral and their kin).

Cache: the draft shares its sequence's own slot of the target's cache, so it needs no prefill of its own.
A draft forward writes keys and values at the draft positions only for the layers it runs (computed from
the shallower stack's hidden states, so not the full model's) and nothing for the skipped ones; settle()
trims the slot back to the text, and the verification pass that follows writes every layer at those
positions afresh. Before the draft positions the slot holds the full model's entries, which the running
layers read as they are: the draft attends to the target's own cache of the context.

The layers the draft does run may be cheaper copies of the target's (DraftStack): each linear on an int8
kernel where one is timed faster here than the target's own, and an output layer over the common tokens
(compact.py's cut). Their values differ a little from the target's, so only acceptance moves: the target's
own modules, untouched, verify every token. On a CPU a decode step is bound by the bytes of the weights it
reads, and skipping layers reads fewer bytes at a high price in agreement (a few skipped layers save little
time and lose about half the agreement), where int8 copies of every layer read half the bytes and agree on most
positions of the target's own greedy text.

Which layers to skip (none, with copies) is calibration's choice (skip_calibration.py).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from draftwise.backends.base import Backend
from draftwise.backends.kernels import (DRAFT_KERNELS, DRAFT_WIDTHS, VALUE_CHANGING, draft_copy, plan_kernels,
                                        planned_kernel)
# The draft stack and the view that runs it live with the backends (backends/skipping.py); named here too, where
# the calibration, the loading and the tests have always found them.
from draftwise.backends.skipping import DraftStack, SkippingBackend, decoder_layers, drafting  # noqa: F401
from draftwise.errors import DraftwiseError
from draftwise.proposers.base import Capabilities
from draftwise.proposers.compact import KEEP_VOCAB, compact_readout
from draftwise.proposers.draft_model import DraftModelProposer


def cheaper_stack(loaded: nn.Module, running: nn.Module, special_ids=(), kernels=DRAFT_KERNELS,
                  keep_vocab: int = KEEP_VOCAB) -> DraftStack:
    """The copies the skip draft runs instead of running's own layers and output layer.

    loaded: the model as loaded (plain nn.Linear), running: the target as the engine runs it (its linears
    repacked on exact kernels, with_kernels). A layer is copied only where some linear of it is timed fastest
    on an int8 kernel (kernels.py); the copy shares every other module and tensor with running's layer. The
    output layer keeps the keep_vocab lowest ids (compact.py), on the kernel timed fastest for it. Off the CPU
    nothing is copied: the kernels are CPU kernels, and there a step is not bound by the bytes of the weights."""
    if any(next(m.parameters()).device.type != "cpu" for m in (loaded, running)):
        return DraftStack()
    plain_layers, fast_layers = decoder_layers(loaded), decoder_layers(running)
    if len(plain_layers) != len(fast_layers):
        raise DraftwiseError(f"the model as loaded has {len(plain_layers)} decoder layers and the running one "
                             f"{len(fast_layers)}: they must be the same model")
    plan = plan_kernels(plain_layers, tuple(kernels), DRAFT_WIDTHS)  # not the output layer: it is cut first
    copies = {}
    for i, (plain, fast) in enumerate(zip(plain_layers, fast_layers)):
        kernels_of = {name: planned_kernel(linear, plan) for name, linear in plain.named_modules()
                      if type(linear) is nn.Linear}
        cheaper = {name: draft_copy(plain.get_submodule(name), kernel) for name, kernel in kernels_of.items()
                   if kernel in VALUE_CHANGING}
        if cheaper:
            copies[i] = _copy_with(fast, cheaper)
    readout, token_ids = _compact_readout(loaded, special_ids, keep_vocab, kernels)
    return DraftStack(layers=copies, readout=readout, token_ids=token_ids)


def _compact_readout(loaded: nn.Module, special_ids, keep_vocab: int,
                     kernels) -> tuple[nn.Module | None, torch.Tensor | None]:
    """(loaded's output layer over the keep_vocab lowest ids and the special ones, on its fastest kernel here,
    the target id of each of its rows), or (None, None) where the vocabulary is no larger or the layer not plain."""
    head = loaded.get_output_embeddings()
    if type(head) is not nn.Linear:
        return None, None
    readout, token_ids = compact_readout(head, special_ids, keep_vocab)
    if readout is None:
        return None, None
    return draft_copy(readout, planned_kernel(readout, plan_kernels(readout, tuple(kernels), DRAFT_WIDTHS))), token_ids


def _copy_with(layer: nn.Module, replacements: dict[str, nn.Module]) -> nn.Module:
    """A copy of layer sharing all its tensors, with the submodules named in replacements swapped."""
    shared = {id(t): t for t in [*layer.parameters(), *layer.buffers()]}
    copied = copy.deepcopy(layer, memo=shared)
    for name, module in replacements.items():
        parent, _, leaf = name.rpartition(".")
        setattr(copied.get_submodule(parent), leaf, module)
    return copied


class LayerSkipProposer(DraftModelProposer):
    """The draft model's round, drafted by the target with layers skipped, in the sequence's target slot.

    The slot holds the text but its last token (the engine's cache rule) at the start of a round, and must
    hold exactly that again at its end: the round feeds the last token and each draft token but the last,
    then settle() trims back; the verification pass appends the same positions with every layer."""

    # No second model and no cache of its own (its cache is the target slot, bound at open): nothing to fill,
    # restore or remember.
    capabilities = Capabilities(drafts_in_steps=True)

    def __init__(self, skipping_backend: SkippingBackend, target_vocab_size: int):
        super().__init__(backend=None, target_vocab_size=target_vocab_size,
                         token_ids=skipping_backend.stack.token_ids)
        self.skipping = skipping_backend

    def bind(self, target_slot: Backend) -> None:
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

    def remember(self, text: list[int]) -> None:
        """The target slot is offered to the prompt cache by the engine."""

    def start(self, context: list[int], k: int, stop_confidence: float = 0.0) -> None:
        self._cached = list(context[:-1])  # what the target slot holds
        super().start(context, k, stop_confidence)

    def settle(self) -> None:
        self._feed = None
        self._end_guided_round()
        self.backend.trim(self._context_len - 1)  # the verification rewrites the draft positions, every layer

    def observe(self, num_accepted: int) -> None:
        """The engine trims the target slot to the accepted text; the draft keeps nothing of its own."""

    def fork(self) -> "LayerSkipProposer":
        return LayerSkipProposer(self.skipping, self.target_vocab_size)

    def fork_on_draft_model(self, proposer_cls: type) -> DraftModelProposer:
        raise DraftwiseError("a layer-skip proposer drafts with the target's own layers, not a draft model")

    def attach_prompt_cache(self, cache) -> None:
        """The target slot it drafts in is the engine's to offer to the prompt cache."""

    def release(self) -> None:
        """The slot is the sequence's target slot: the engine frees it."""
