"""Hugging Face transformers as a backend: any causal LM, one slot cache shared by many sequences."""
from __future__ import annotations

import inspect
import os
from contextlib import contextmanager

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from draftwise.backends.base import SharedBackend, SlotView
from draftwise.backends.capabilities import BackendCapabilities
from draftwise.backends.prefix_cache import PrefixCache
from draftwise.backends.quant_stack import layer_structs, runs_in_one_call, stack_logits
from draftwise.backends.slots import Slot, SlotCache
from draftwise.errors import DraftwiseError
from draftwise.models.gguf_file import refuse_rope_factors
from draftwise.hardware import resolve_dtype
from draftwise.progress import transformers_progress

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class HFBackend(SharedBackend):
    """A model and one SlotCache: sequences open slots, and one forward serves a ragged batch of them.

    The single-sequence methods (prefill, forward, trim, cache_len) act on `default`, a slot opened here,
    so code that runs one sequence at a time needs no slot at all.

    cache: the SlotCache itself (the tests of the cache and of the quant layers' writes read its buffers)."""

    backend_name = "hf"
    # Batch-invariant on the invariant kernel (loading.resolve_invariance picks it by default on a CPU).
    capabilities = BackendCapabilities(trees=True, hidden_states=True, layer_access=True, prompt_cache=True,
                                       batch_invariant=True, dtypes=tuple(_TORCH_DTYPES))

    def __init__(self, model: PreTrainedModel):
        self._model = model.eval()
        config = model.config.get_text_config()
        self.vocab_size: int = model.get_output_embeddings().out_features  # a packed head has no plain .weight
        self.max_context: int = int(getattr(config, "max_position_embeddings", 1 << 30))
        self._windows = attention_windows(config)
        self._bool_mask = getattr(config, "_attn_implementation", "sdpa") != "eager"
        self._cache_keyword = cache_keyword(model)
        self._on_blocks = runs_in_one_call(model)  # (whether a pass may take quant_stack's loop; checked per pass)
        self.cache = SlotCache()
        self.default = self.open_slot()
        self._prefix_cache: PrefixCache | None = None  # the prompt cache, shared with other models
        self._prefix_name = ""  # this model's name in it ("target", "draft")
        self.feature_layers: tuple[int, ...] = ()  # decoder layers whose outputs `hidden` returns too (a fused head)

    @property
    def model(self) -> PreTrainedModel:
        return self._model

    def attach_prompt_cache(self, cache: PrefixCache, name: str) -> None:
        self._prefix_cache, self._prefix_name = cache, name

    def close(self) -> None:
        """Nothing outside Python's memory: the weights and the cache go with the last reference to them."""

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def open_slots(self) -> int:
        return len(self.cache.slots)

    @property
    def embedding_rows(self) -> int:
        return embedding_rows(self.model)

    def open_slot(self) -> "HFSlot":
        return HFSlot(self, self.cache.open_slot())

    def close_slot(self, view: "HFSlot") -> None:
        self.cache.close_slot(view.slot)

    # -- ragged batches --------------------------------------------------------------------------------
    def forward_batch(self, rows: list[tuple["HFSlot", list[int]]], logits: bool = True,
                      trees: list | None = None, hidden: bool = False):
        """Append each row's new ids to its slot; return float32 logits [n_i, vocab] per row (empty when not
        logits: a prefill needs only the cache). Lengths move only once the whole pass has succeeded.

        hidden: also return each row's last hidden states [n_i, H] (after the final norm: what the output layer
        reads; with feature_layers, those layers' outputs before it, [n_i, (layers + 1) H]), as (logits per row,
        hidden states per row), for a proposer that drafts from them.

        trees: per row, None or the TreeLayout of its ids (a root and a token tree, types.py): the row's
        positions are written in order, but each token's position id is its depth past the root and it
        attends to the cache and its own ancestors only. A layout longer than the row's ids continues a tree
        already in the slot (a draft model grows its tree one depth per forward): its first positions, the root
        among them, are the slot's last ones, and the ids are its last len(ids) positions. Before the tree,
        the slot holds plain text, which every tree token sees."""
        slots = [view.slot for view, _ in rows]
        lengths = [len(ids) for _, ids in rows]
        width = max(lengths)
        for slot, n in zip(slots, lengths):
            if slot.length + n > self.max_context:
                raise DraftwiseError(
                    f"sequence of {slot.length + n} tokens exceeds the model's context of {self.max_context}")
        with last_hidden_states(self.model, hidden, self.feature_layers) as captured:
            out = self._run(slots, [ids for _, ids in rows], width, logits_to_keep=width if logits else 1,
                            trees=trees or [None] * len(rows))
        for slot, n in zip(slots, lengths):
            slot.length += n
        if not logits:
            per_row = [out.new_empty(0, self.vocab_size) for _ in rows]
        else:
            per_row = [out[i, :n].float() for i, n in enumerate(lengths)]  # [n_i, vocab] each
        if hidden:
            return per_row, [captured[0][i, :n] for i, n in enumerate(lengths)]  # [n_i, H] each
        return per_row

    @torch.inference_mode()
    def _run(self, slots: list[Slot], ids: list[list[int]], width: int, logits_to_keep: int,
             trees: list) -> torch.Tensor:
        device = self.device
        padded = [row + [row[-1]] * (width - len(row)) for row in ids]  # padding lands past each row's length
        input_ids = torch.tensor(padded, dtype=torch.long, device=device)  # [B, N]
        positions = self.cache.begin_forward(slots, width, device)  # [B, N] where each row's tokens are written
        end = int(positions[:, -1].max()) + 1
        position_ids = positions.clone() if any(t is not None for t in trees) else positions
        lengths = [len(row) for row in ids]
        for row, tree in enumerate(trees):
            if tree is not None:  # a token's position id is the root's plus its depth
                n, behind = lengths[row], len(tree.depth) - lengths[row]  # behind: the tree's positions in the slot
                if not 0 <= behind <= slots[row].length:
                    raise ValueError(f"a tree of {len(tree.depth)} positions for {n} new ids and a slot of "
                                     f"{slots[row].length}")
                root = positions[row, 0] - behind
                position_ids[row, :n] = root + torch.tensor(tree.depth[behind:], device=device)
        if min(lengths) < width:  # a short row's padding: no query sees its keys, but a learned position table
            position_ids = position_ids.clone() if position_ids is positions else position_ids  # (GPT-2's) must
            for row, n in enumerate(lengths):  # still hold its ids, so it repeats the row's last
                position_ids[row, n:] = position_ids[row, n - 1]
        mask = self._masks(positions, end, trees, position_ids, lengths)
        structs = layer_structs(self.model) if self._on_blocks and torch.is_tensor(mask) else None
        if structs is not None:  # every layer in one call: the loop of those calls, past transformers' dispatch
            return stack_logits(self.model, structs, input_ids, mask, position_ids, self.cache, logits_to_keep)
        out = self.model(input_ids=input_ids, **{self._cache_keyword: self.cache}, use_cache=True,
                         attention_mask=mask, position_ids=position_ids, logits_to_keep=logits_to_keep)
        return out.logits  # [B, logits_to_keep, vocab]

    def _masks(self, positions: torch.Tensor, end: int, trees: list, position_ids: torch.Tensor | None = None,
               lengths: list[int] | None = None):
        """Row i, query t sees keys [0, position] (the last `window` of them on sliding layers): [B, 1, N, end].
        A tree row's tokens see, of the tree's positions, only their ancestors and themselves; its windows count
        position ids (a key's depth, not its slot), as the chain through those ancestors would have them.

        position_ids: [B, N] the queries' (positions by default); lengths: each row's new ids (default: a tree's
        whole layout is new)."""
        position_ids = positions if position_ids is None else position_ids
        keys = torch.arange(end, device=positions.device)  # [end]
        visible = keys <= positions[:, None, :, None]  # [B, 1, N, end]
        key_ids = keys.repeat(len(positions), 1)  # [B, end]: each key's position id
        for row, tree in enumerate(trees):
            if tree is not None:
                size = len(tree.depth)
                n = size if lengths is None else lengths[row]
                root = int(positions[row, 0]) - (size - n)  # where the tree starts in the slot
                visible[row, 0, :n, root : root + size] &= tree.visible[size - n :].to(visible.device)
                key_ids[row, root : root + size] = root + torch.tensor(tree.depth, device=positions.device)
        masks = {}
        for layer_type, window in self._windows.items():
            seen = visible
            if window:  # [B, 1, N, end]
                seen = visible & (key_ids[:, None, None, :] > position_ids[:, None, :, None] - window)
            masks[layer_type] = seen if self._bool_mask else _additive(seen, self.dtype)
        return masks.get(None, masks)  # one mask for every layer, or one per layer type


class HFSlot(SlotView):
    """One sequence's slot of an HFBackend: SlotView's methods, and those that touch the SlotCache itself."""

    def keep(self, start: int, sources: list[int]) -> None:
        self.backend.cache.keep(self.slot, start, sources)

    # -- the prompt cache ------------------------------------------------------------------------------
    def restore(self, token_ids: list[int]) -> int:
        """Fill the slot from the prompt cache's longest entry sharing a prefix with token_ids; returns how
        many positions it now holds (0: nothing cached, the slot is left empty)."""
        cache = self.backend._prefix_cache
        self.slot.length = 0
        if cache is None:
            return 0
        entry, length = cache.longest(self.backend._prefix_name, token_ids)
        if entry is not None:
            self.backend.cache.load(self.slot, entry.keys, entry.values, length)
        return length

    def remember(self, token_ids: list[int]) -> None:
        """Offer the slot's first positions, the keys and values of token_ids' first ones, to the prompt cache.
        The slot may hold fewer (the text's last token) or more (draft tokens kept past an EOS or a stop string
        that ended the text): its common part with token_ids is what is offered."""
        cache = self.backend._prefix_cache
        length = min(self.slot.length, len(token_ids))
        if cache is not None and length:
            cache.put(self.backend._prefix_name, token_ids[:length], *self.backend.cache.export(self.slot, length))


@contextmanager
def last_hidden_states(model, enabled: bool = True, layers: tuple[int, ...] = ()):
    """Within the block, captured[0] is the decoder's last output ([B, N, H], after the final norm). With `layers`,
    the outputs of those decoder layers (0: the first; the residual stream, before any norm) come first, in layer
    order: [B, N, (len(layers) + 1) H], EAGLE-3's low, middle and high features."""
    captured: list[torch.Tensor] = []
    if not enabled:
        yield captured
        return
    decoder = model.get_decoder()
    inner: list[torch.Tensor] = []  # this forward's layer outputs, in the order the layers ran

    def keep_layer(_module, _args, out):
        inner.append(out[0] if isinstance(out, tuple) else out)

    def keep_last(_module, _args, out):
        captured.insert(0, torch.cat([*inner, out.last_hidden_state], dim=-1) if inner else out.last_hidden_state)
        inner.clear()

    hooks = [decoder.layers[i].register_forward_hook(keep_layer) for i in layers]
    hooks.append(decoder.register_forward_hook(keep_last))
    try:
        yield captured
    finally:
        for hook in hooks:
            hook.remove()


def embedding_rows(model) -> int:
    """The ids a model's input embedding reads (its rows)."""
    return model.get_input_embeddings().num_embeddings


def cache_keyword(model) -> str:
    """The name model.forward takes its cache by: `cache` in the transformers releases that renamed it (they warn
    on every process's first `past_key_values`, which a user would see mid-stream), else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def attention_windows(config) -> dict[str | None, int | None]:
    """The masks a model needs: {None: window} for one mask on every layer, or one per layer type. A window only
    where the model itself slides: a config that types its layers slides on its "sliding_attention" ones alone
    (Qwen2 with use_sliding_window and max_window_layers covering every layer keeps sliding_window set, yet attends
    to all of its cache), and use_sliding_window=False turns the window off; an untyped config (Mistral) slides on
    every layer by its sliding_window."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(config, "layer_types", None) or ()
    if "sliding_attention" in layer_types:
        return {"full_attention": None, "sliding_attention": window}
    return {None: None if layer_types else window}


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Eager attention adds its mask to the scores."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
        ~visible, torch.finfo(dtype).min)


def torch_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """The torch dtype of a dtype name; 'auto' resolves for device (see hardware.py)."""
    return _TORCH_DTYPES[resolve_dtype(name, device)]


# A file damaged after it was stored fails only when read; a model of the store can be fetched again.
REPULL_HINT = "; if it is a model of the store, `draftwise models pull NAME --force` fetches it again"


def load_tokenizer(path: str, gguf_file: str | None = None):
    """The tokenizer alone: seconds, so a draft/target mismatch is caught before a model loads."""
    # Never the model's own code: a folder naming a class transformers lacks is refused, not asked about mid-load.
    kwargs = {"trust_remote_code": False, **({"gguf_file": gguf_file} if gguf_file else {})}
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as err:  # a damaged file fails in whichever reader meets it first (safetensors, gguf, json)
        raise DraftwiseError(f"could not load a tokenizer from {path}: {err}{REPULL_HINT}") from err


def load_model(path: str, gguf_file: str | None = None, dtype: str = "auto", device: str = "cpu",
               progress: bool = True) -> PreTrainedModel:
    """A causal LM from a local folder, or a .gguf file inside it, cast to dtype."""
    if gguf_file:
        refuse_rope_factors(os.path.join(path, gguf_file))
    kwargs = {"trust_remote_code": False, **({"gguf_file": gguf_file} if gguf_file else {})}
    try:
        with transformers_progress(progress):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype, device), **kwargs)
    except Exception as err:  # as for the tokenizer: a truncated .safetensors is a SafetensorError, a .gguf an IndexError
        raise DraftwiseError(f"could not load a causal language model from {path}: {err}{REPULL_HINT}") from err
    return model.to(device)


def load_hf(path: str, gguf_file: str | None = None, dtype: str = "auto", device: str = "cpu", progress: bool = True):
    """(model, tokenizer) from a local folder, or a .gguf file inside it."""
    return load_model(path, gguf_file, dtype, device, progress), load_tokenizer(path, gguf_file)
