"""The target seen as its own draft model: its forward with some decoder layers passed over and others swapped for
cheaper copies (layer skipping, proposers/layer_skip.py), over views of the target's own slots.

A view, not a model of its own: SkippingBackend keeps the backend contract (base.py) so a proposer drafts on it as
on any draft model, but every slot it has is a slot of the target's cache, and every pass is the target's
forward_batch with the draft stack swapped in for the length of the call. The draft's keys and values land in the
target's slot at the draft positions and are trimmed away before the verification pass writes them afresh.

What the view declares: token trees (the target scores them; the swap changes no mask). Not its hidden states (a
shallower stack's are no feature a head was trained on), not its layers (they are the target's, reached through
the target), not a prompt cache (its slots are the target's, which the engine restores and remembers)."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from draftwise.backends.base import Backend, SharedBackend, SlotView
from draftwise.backends.capabilities import BackendCapabilities
from draftwise.backends.kernels import kernel_counts
from draftwise.errors import DraftwiseError


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


@dataclass(eq=False)
class DraftStack:
    """What the skip draft runs in place of the target's own modules. With no copies and no readout it is the
    target itself, less the skipped layers: nothing copied."""

    skip: tuple[int, ...] = ()  # the decoder layers passed over
    layers: dict[int, nn.Module] = field(default_factory=dict)  # layer index -> its copy on int8 kernels
    readout: nn.Module | None = None  # an output layer over token_ids only
    token_ids: torch.Tensor | None = None  # [kept]: the target id of each readout row

    @property
    def cheaper(self) -> bool:
        """Whether the layers it runs cost less than the target's own (so skipping none can pay)."""
        return bool(self.layers) or self.readout is not None

    def skipping(self, skip) -> "DraftStack":
        """This stack passing over the layers in skip (their copies, which would never run, are dropped)."""
        skip = tuple(sorted(skip))
        return replace(self, skip=skip, layers={i: m for i, m in self.layers.items() if i not in skip})

    def layer_kernels(self) -> dict[str, int]:
        """How many of the copies' linears run on each kernel, e.g. {"int8-dynamic": 140, "int8": 56}."""
        return kernel_counts(nn.ModuleList(self.layers.values())) if self.layers else {}

    def describe(self) -> str:
        """What the stack runs, for the calibration cache key: its copies' kernels and its readout's width."""
        readout = f"{kernel_counts(self.readout)}x{len(self.token_ids)}" if self.readout is not None else "full"
        return f"layers={sorted(self.layer_kernels().items())}:readout={readout}"


@contextmanager
def drafting(model: nn.Module, stack: DraftStack):
    """Within the block, model runs as the draft: the layers in stack.skip passed over, the others and the output
    layer swapped for the stack's copies where it has them. Everything is put back after, whatever happens."""
    layers = decoder_layers(model)
    passing = _PassThrough()
    swaps = {i: copied for i, copied in stack.layers.items() if i not in stack.skip}
    swaps.update({i: passing for i in stack.skip})
    saved = {i: layers[i] for i in swaps}
    head = model.get_output_embeddings()
    try:
        for i, module in swaps.items():
            layers[i] = module
        if stack.readout is not None:
            model.set_output_embeddings(stack.readout)
        yield
    finally:
        for i, layer in saved.items():
            layers[i] = layer
        model.set_output_embeddings(head)


class SkippingBackend(SharedBackend):
    """The target's backend seen as a draft model: every forward runs the target as the stack says.

    target: the backend it drafts on (one that declares layer_access); stack, skip: what the draft runs in place of
    the target's own modules, and the layers it passes over; view(target_slot): the draft's view of a slot."""

    backend_name = "skip"  # a view of the target's, never a --backend choice (not in methods.BACKENDS)
    capabilities = BackendCapabilities(trees=True, dtypes=("float32", "bfloat16"))

    def __init__(self, target: SharedBackend, stack: DraftStack):
        if not target.capabilities.layer_access:
            raise DraftwiseError(f"method 'skip' runs some of the target's layers, which the {target.backend_name} "
                                 "backend does not give; it runs on --backend hf or quant")
        count = len(decoder_layers(target.model))
        skip = stack.skip
        if any(not 0 <= i < count for i in skip) or len(set(skip)) != len(skip) or len(skip) >= count:
            raise DraftwiseError(f"layers to skip must be distinct, between 0 and {count - 1}, and leave at "
                                 f"least one; got {list(skip)}")
        if not skip and not stack.cheaper:
            raise DraftwiseError("a skip draft that skips no layer must run cheaper copies of them (int8 "
                                 "kernels), or it would be the target itself; got no layers to skip")
        self.target = target
        self.stack = stack.skipping(skip)
        self.feature_layers: tuple[int, ...] = ()  # (no hidden states here: never read)
        self.default = self.view(target.default)

    @property
    def skip(self) -> tuple[int, ...]:
        return self.stack.skip

    @property
    def vocab_size(self) -> int:
        """The width of the draft's logits rows: the compact readout's, or the target's."""
        return self.target.vocab_size if self.stack.token_ids is None else len(self.stack.token_ids)

    max_context = property(lambda self: self.target.max_context)
    device = property(lambda self: self.target.device)
    dtype = property(lambda self: self.target.dtype)
    embedding_rows = property(lambda self: self.target.embedding_rows)
    open_slots = property(lambda self: self.target.open_slots)  # its slots are the target's

    @property
    def model(self):
        raise DraftwiseError("a skip draft's layers are the target's: reach them through the target's backend")

    def view(self, target_slot: Backend) -> "SkippingSlot":
        """The draft's view of one sequence: that sequence's own slot of the target's cache."""
        return SkippingSlot(self, target_slot)

    def open_slot(self) -> "SkippingSlot":
        return self.view(self.target.open_slot())

    def close_slot(self, view: "SkippingSlot") -> None:
        view._target_slot.close()

    def forward_batch(self, rows: list[tuple["SkippingSlot", list[int]]], logits: bool = True,
                      trees: list | None = None, hidden: bool = False):
        if hidden:
            raise DraftwiseError("a skip draft gives no hidden states (a shallower stack's are no target feature)")
        with drafting(self.target.model, self.stack):
            return self.target.forward_batch(rows, logits=logits, trees=trees)

    def attach_prompt_cache(self, cache, name: str) -> None:
        raise DraftwiseError("a skip draft keeps no prompt cache: its slots are the target's, which the engine "
                             "offers to the prompt cache")

    def close(self) -> None:
        """Nothing of its own: the model and the slots are the target's."""


class SkippingSlot(SlotView):
    """The skip draft's view of a slot of the target's cache: a forward runs the draft stack, keep moves the
    target's own cache positions. No prompt cache of its own (SlotView's restore and remember)."""

    def __init__(self, backend: SkippingBackend, target_slot: Backend):
        super().__init__(backend, target_slot.slot)
        self._target_slot = target_slot  # the target's view of the same slot

    def keep(self, start: int, sources: list[int]) -> None:
        self._target_slot.keep(start, sources)
