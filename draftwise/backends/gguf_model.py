"""The GGUF file as published is the model: a transformers skeleton without weights, filled from the file.

    model = load_gguf_model(path)            # a Qwen2ForCausalLM, LlamaForCausalLM, ... whose linears are QuantLinear

The skeleton is built on the meta device from the config (the file's metadata, or the config.json the store saved from
it), so no float copy of the model is ever made. Then, tensor by tensor:
- each linear (and a tied output layer) becomes a QuantLinear on the file's own blocks, packed for qgemm.c (a
  draft's wider blocks re-quantized to 4 bits: draft=True);
- the token embedding becomes a QuantEmbedding: the file's rows, de-quantized only when looked up;
- norms and biases are the file's float tensors, read as transformers' GGUF loader reads them (its processor: the
  same values, bit for bit);
- buffers the model computes (the rotary inverse frequencies, Gemma's embedding scale) are computed on the CPU by
  the model's own initialisation, as transformers' from_pretrained does.
The result runs the same kernels, in the same order, on the same values as a float model swapped onto the same blocks
(quant_model.on_gguf_weights): its logits are the same bits.
"""
from __future__ import annotations

import copy
import mmap
import re
from pathlib import Path

import numpy as np
import torch
from torch import nn

from draftwise.backends.gguf_cache import PackCache
from draftwise.models.gguf_file import ROPE_FACTORS, GGUFFile, rope_factors
from draftwise.backends.gguf_weights import DECODERS, check_draft_bits, pack_raw, requantize_draft
from draftwise.models.packed import FILE_BLOCKS
from draftwise.backends.qgemm import QuantLinear
from draftwise.errors import DraftwiseError
from draftwise.progress import bar

FLOAT_TYPES = ("F32", "F16", "BF16")
# A draft's blocks: the file's, those wider than 4 bits re-quantized (requantize_draft), in a pack cache of their own
# (rename it when quantize_draft's output changes: a cache of the old one is then not read); a draft on 2 bits (its
# decoder layers' blocks all re-quantized to 2 bits, its output layer as a 4-bit draft's) in another
DRAFT_BLOCKS = "q4"
LAYER_PREFIX = "model.layers."  # the decoder layers' modules, in every family the backend loads


def draft_blocks(bits: int = 4) -> str:
    """The pack cache of a draft whose decoder layers are on `bits`-bit blocks."""
    return DRAFT_BLOCKS if bits == 4 else f"q{bits}"


# GGUF architectures the quant backend runs, with the transformers families they load as (llama.cpp writes Mistral
# and SmolLM2 as "llama"). Others are refused by name before anything loads.
ARCHITECTURES = {"qwen2": "Qwen2", "llama": "Llama, SmolLM2, Mistral", "qwen3": "Qwen3", "gemma3": "Gemma 3",
                 "phi3": "Phi-3"}
# Why some that transformers has a class for are not run (the rest: no transformers class reads their GGUF files)
NOT_RUN = {"gemma2": "its attention soft cap, which the batch-invariant attention does not compute",
           "qwen2moe": "its experts, which have no quantized kernel here", "qwen3moe": "its experts, which have no "
           "quantized kernel here", "mistral3": "transformers has no GGUF loader for it (llama.cpp's newer Mistral "
           "files)"}


KEPT_ROW_BYTES = 16 << 20  # de-quantized rows a QuantEmbedding keeps: about 2,700 of a 1.5B model's 1536 floats
KEPT_LOOKUP = 64  # lookups of up to this many ids (a decoding step's) go through the kept rows; a prefill's do not


class QuantEmbedding(nn.Module):
    """A token embedding on a GGUF file's quantized rows [vocab, bytes a row] (a view of the mapped file): the rows
    looked up are de-quantized with the gguf package's own arithmetic, the values transformers' loader gives the
    whole table; the table itself is never made (weight makes it, for the few callers that need it all)."""

    def __init__(self, raw: np.ndarray, type_name: str, num_embeddings: int, embedding_dim: int,
                 embed_scale: torch.Tensor | None = None):
        super().__init__()
        import gguf

        self.raw = raw  # [vocab, bytes a row] uint8
        self.type_name = type_name
        self._qtype = gguf.GGMLQuantizationType[type_name]
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = None
        self._kept: dict[int, torch.Tensor] = {}  # id -> its de-quantized row [dim] (_kept_rows)
        self._kept_limit = max(1, KEPT_ROW_BYTES // (4 * embedding_dim))
        # Gemma multiplies the looked-up rows by sqrt(hidden) (Gemma3TextScaledWordEmbedding): kept as it does
        self.register_buffer("embed_scale", embed_scale, persistent=False)

    def _rows(self, ids: np.ndarray) -> torch.Tensor:
        import gguf

        return torch.from_numpy(gguf.quants.dequantize(self.raw[ids], self._qtype).reshape(len(ids), -1))

    def _kept_rows(self, ids: np.ndarray) -> torch.Tensor:
        """[len(ids), dim]: the rows of a few ids, from those kept since their first lookup (a decoding step looks up
        one or a few; the gguf package's arithmetic costs about 0.1 ms a call however few, more after a pass has
        pushed it out of the caches); the others de-quantized together and kept, while the budget holds them."""
        kept, wanted = self._kept, {int(i) for i in ids}
        missing = sorted(wanted - kept.keys())
        if missing:
            if len(kept) + len(missing) > self._kept_limit:  # (a text's recurring tokens come back within a few steps)
                kept.clear()
                missing = sorted(wanted)
            kept.update(zip(missing, self._rows(np.array(missing))))
        return torch.stack([kept[int(i)] for i in ids])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1).cpu().numpy()  # [tokens]
        if len(flat) and (flat.min() < 0 or flat.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        rows = self._kept_rows(flat) if 0 < len(flat) <= KEPT_LOOKUP else self._rows(flat)  # [tokens, dim] float32
        rows = rows.reshape(*input_ids.shape, self.embedding_dim)  # [..., dim]
        if self.embed_scale is not None:
            rows = rows * self.embed_scale.to(rows.dtype)
        return rows

    @property
    def weight(self) -> torch.Tensor:
        """[vocab, dim] float32, made on each call (a gigabyte for a 1.5B model's table; a head's training reads it)."""
        return self._rows(np.arange(self.num_embeddings))

    def __deepcopy__(self, memo) -> "QuantEmbedding":
        """A copy shares the file's rows (read-only)."""
        twin = copy.copy(self)
        twin._buffers, twin._parameters, twin._modules = dict(self._buffers), dict(self._parameters), {}
        memo[id(self)] = twin
        return twin

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.type_name} rows"


def load_gguf_model(path: str | Path, config=None, progress: bool = True, cache: bool = True, draft: bool = False,
                    sharing=None, draft_bits: int = 4):
    """The transformers model of a GGUF file, its linears on the file's blocks (QuantLinear), its embedding rows
    de-quantized on lookup; config: the model's config when the caller has it (the store saved it at pull), else read
    from the file's metadata. Refuses a file it cannot run by name, before reading any weight.

    cache: take the blocks already packed for the kernel from the file's pack cache (gguf_cache.py: read back, not
    packed again), and write one after packing them, so that the next load only reads them; the same bytes either way.
    Either way the blocks end on huge pages (huge_pages.py), which a step streams faster.

    draft: the model is a draft, whose values may move (the target verifies every token it proposes): its linears on
    blocks wider than 4 bits (Q6_K, Q8_0, ...) are re-quantized to 4 bits, which a forward reads fewer bytes of,
    and kept in a pack cache of their own (DRAFT_BLOCKS), so a target's of the same file is left as it is.
    draft_bits: 2 re-quantizes a draft's decoder layers, every linear of them, to 2 bits (2.5 bits a weight with
    their scales; the output layer stays as at 4): a draft forward reads about 45% fewer bytes.
    sharing: a model loaded from the same file (the target, drafting for itself): the linears the draft keeps on the
    file's blocks are that model's own modules, not loaded again; it is not changed."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from draftwise.backends.quant_model import _on_quant_layers

    file = GGUFFile(path)
    check_architecture(file)
    config = config if config is not None else gguf_config(file.path)
    model = skeleton(config)
    divide_rope_frequencies(model, file)
    processor = TENSOR_PROCESSORS.get(file.architecture, TensorProcessor)(config=config.to_dict())
    names = tensor_names(model, file.architecture)  # GGUF tensor -> parameter ("blk.0.attn_q.weight" -> ...)
    plan = _plan(file, model, names)
    floats = {}
    for tensor, target in plan:  # norms, biases and any float linear: small, as transformers reads them
        if tensor.tensor_type.name in FLOAT_TYPES:
            floats[target] = _float_tensor(tensor, processor, file.path.name)
    modules = dict(model.named_modules())
    embedding = model.get_input_embeddings()
    embedding_name = _parameter_of(model, embedding)
    tied = "output.weight" not in file.tensors
    check_draft_bits(draft_bits)  # (before any weight is read)
    linears = _Linears(file, config, cache, draft, sharing, draft_bits)
    desc = f"{draft_bits}-bit draft" if draft else "quantized weights"
    for tensor, target in bar(plan, desc=desc, disable=not progress):
        module_name, _, attribute = target.rpartition(".")
        if tensor.tensor_type.name in FLOAT_TYPES:
            _set(modules[module_name], attribute, floats[target], target, file.path.name)
            if tied and target == embedding_name:
                _set(model.get_output_embeddings(), "weight", floats[target], target, file.path.name)
            continue
        n, k = int(tensor.shape[1]) if len(tensor.shape) > 1 else 1, int(tensor.shape[0])
        if target == embedding_name:
            _replace(model, modules, module_name, QuantEmbedding(_own_map(file.path, tensor, n),
                                                                 tensor.tensor_type.name, n, k, _embed_scale(embedding)))
            if not tied:
                continue
            module_name = _parameter_of(model, model.get_output_embeddings()).rpartition(".")[0]
        _replace(model, modules, module_name, linears.linear(tensor, module_name, n, k,
                                                             floats.get(f"{module_name}.bias")))
    _check_complete(model, file.path.name)
    linears.save()
    return _on_quant_layers(model.eval())


class _Linears:
    """Each linear of a load on the kernel: a shared model's own module, the pack cache's blocks, or blocks
    packed here from the file's (re-quantized to 4 bits where a draft's are wider); then, if any were packed here,
    the cache written once, whole."""

    def __init__(self, file: GGUFFile, config, cache: bool, draft: bool, sharing, draft_bits: int = 4):
        self.file, self.config, self.draft, self.draft_bits = file, config, draft, draft_bits
        self.packs = PackCache.of(file.path, draft_blocks(draft_bits) if draft else FILE_BLOCKS) if cache else None
        self.shared = dict(sharing.named_modules()) if sharing is not None else {}
        self.packed, self.fresh = {}, False  # every tensor this cache holds (for it to write), whether any is new

    def linear(self, tensor, module_name: str, n: int, k: int, bias: torch.Tensor | None) -> QuantLinear:
        type_name = tensor.tensor_type.name
        bits = self.requantized_bits(type_name, module_name)
        shared = self.shared.get(module_name)
        if bits is None and isinstance(shared, QuantLinear) and (shared.out_features, shared.in_features) == (n, k):
            return shared
        order, order_key = _channel_order(tensor.name, n, self.file.architecture, self.config)
        packed = self.packs.get(tensor.name, order_key) if self.packs is not None else None
        if packed is None:
            packed = (pack_raw(type_name, tensor.data, n, k, order) if bits is None
                      else requantize_draft(type_name, tensor.data, n, k, order, bits))
            self.fresh = True
            packed = packed.on_huge_pages()
            _let_go(self.file, tensor)
        self.packed[tensor.name] = (packed, order_key)
        return QuantLinear(packed, bias)

    def requantized_bits(self, type_name: str, module_name: str) -> int | None:
        """The bits a draft's linear is re-quantized to, or None for the file's own blocks."""
        if not self.draft:
            return None
        if self.draft_bits < 4 and module_name.startswith(LAYER_PREFIX):
            return self.draft_bits
        return 4 if DECODERS[type_name][3] > 4 else None

    def save(self) -> None:
        if self.packs is not None and self.fresh:
            self.packs.save(self.packed)


def _channel_order(tensor: str, rows: int, architecture: str, config) -> tuple[np.ndarray | None, str]:
    """(the order of a weight's output channels in the model, None for the file's; a name for it): llama.cpp writes a
    Llama q or k projection with its rotary halves interleaved, which transformers' loader undoes
    (quant_model._model_order, for blocks)."""
    from draftwise.backends.quant_model import llama_order

    if architecture != "llama" or not re.search(r"\.attn_[qk]\.", tensor):
        return None, "file"
    heads = config.num_attention_heads if ".attn_q." in tensor else config.num_key_value_heads
    return llama_order(rows, heads), f"llama-{heads}"


def _let_go(file: GGUFFile, tensor) -> None:
    """Drop the pages of a tensor's bytes from this process (they stay in the page cache): once packed they are not
    read again, and holding them would count the file twice in the load's peak memory."""
    page = mmap.PAGESIZE
    begin = -(-int(tensor.data_offset) // page) * page
    end = (int(tensor.data_offset) + int(tensor.n_bytes)) // page * page
    if end > begin and hasattr(file.mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        file.mm.madvise(mmap.MADV_DONTNEED, begin, end - begin)


def tensor_names(model: nn.Module, architecture: str) -> dict[str, str]:
    """{GGUF tensor name: the model's parameter}, by the gguf package's name table for the file's architecture (the
    map transformers' GGUF loader builds, made once for the whole model rather than once a module)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise DraftwiseError(f"the gguf package has no tensor names for {architecture} files")
    table = get_tensor_name_map(arch, model.config.num_hidden_layers)
    names = {}
    for parameter in model.state_dict():
        stem, dot, suffix = parameter.rpartition(".")
        gguf_name = table.get_name(stem) if suffix in ("weight", "bias") else None
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = parameter
    return names


def check_architecture(file: GGUFFile) -> None:
    if file.architecture not in ARCHITECTURES:
        runs = "; ".join(f"{arch} ({families})" for arch, families in ARCHITECTURES.items())
        why = f" ({NOT_RUN[file.architecture]})" if file.architecture in NOT_RUN else ""
        raise DraftwiseError(f"{file.path.name}: the quant backend runs the GGUF architectures {runs}, not "
                             f"{file.architecture!r}{why}: use --backend llamacpp or --backend hf for it")


def gguf_config(path: Path):
    """The transformers config a GGUF file's metadata describes (as from_pretrained(..., gguf_file=) reads it)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as err:  # an architecture transformers has no class for, a field it cannot parse
        raise DraftwiseError(f"{path.name}: transformers cannot read a model config from this GGUF file "
                             f"({type(err).__name__}: {err})") from None
    if hasattr(config, "quantization_config"):  # (what transformers' own de-quantizing load would use)
        del config.quantization_config
    return config


def skeleton(config):
    """The model of config with every parameter and buffer on the meta device (no memory), then the buffers it
    computes itself made on the CPU by its own initialisation (what from_pretrained does for them)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for module in model.modules():
        meta = [name for name, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]
        if meta:
            for name in meta:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            with torch.no_grad():
                model._init_weights(module)  # (its parameters are still meta: only the buffers get values)
    return model


def divide_rope_frequencies(model: nn.Module, file: GGUFFile) -> None:
    """Scale the rotary frequencies by the file's divisors (Llama 3.1's rope_freqs), as llama.cpp does: theta / f.
    The config carries no scaling for such files, so without this every position would rotate as a Llama 3's."""
    factors = rope_factors(file)
    if factors is None:
        return
    rotaries = [module for module in model.modules() if isinstance(getattr(module, "inv_freq", None), torch.Tensor)]
    for rotary in rotaries:
        if rotary.inv_freq.shape != factors.shape:
            raise DraftwiseError(f"{file.path.name}: {ROPE_FACTORS} has {factors.size} values but the model rotates "
                                 f"{rotary.inv_freq.numel()} frequencies (a corrupt file, or metadata that does not "
                                 "match it)")
        divided = rotary.inv_freq / torch.from_numpy(factors)  # [head_dim / 2]
        rotary.inv_freq = divided
        rotary.original_inv_freq = divided.clone()  # (what transformers' dynamic rotary types reset to)


def _plan(file: GGUFFile, model: nn.Module, names: dict[str, str]) -> list:
    """(tensor, parameter name) for every tensor of the file the model has, checked against the skeleton: shapes fit,
    quantized types are ones the kernel reads, and the tensors the model needs are there. Nothing is read yet."""
    shapes = {name: tuple(t.shape) for name, t in [*model.named_parameters(remove_duplicate=False),
                                                    *model.named_buffers(remove_duplicate=False)]}
    plan, unread = [], sorted({t.tensor_type.name for t in file.tensors.values()}
                              - set(DECODERS) - set(FLOAT_TYPES))
    if unread:
        raise DraftwiseError(f"{file.path.name}: its tensors are {', '.join(unread)} blocks, which the quant backend "
                             f"does not read (it reads {', '.join(DECODERS)}); use --backend llamacpp for this file")
    for name, tensor in file.tensors.items():
        target = names.get(name)
        if target is None or target not in shapes:
            continue
        want = shapes[target]
        have = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        if have != want:
            raise DraftwiseError(f"{file.path.name}: tensor {name} is [{', '.join(map(str, have))}] but the "
                                 f"{model.config.model_type} model its metadata describes has {target} "
                                 f"[{', '.join(map(str, want))}] (a corrupt file, or metadata that does not match it)")
        plan.append((tensor, target))
    return plan


def _own_map(path: Path, tensor, rows: int) -> np.ndarray:
    """The tensor's bytes [rows, bytes a row] in a map of their own: the reader's map of the whole file (whose pages
    the load read once, to pack the blocks) is let go with the reader, and only the rows looked up are read again."""
    return np.memmap(path, dtype=np.uint8, mode="r", offset=int(tensor.data_offset),
                     shape=(rows, int(tensor.n_bytes) // rows))


def _float_tensor(tensor, processor, file: str) -> torch.Tensor:
    """A float tensor of the file as transformers' GGUF loader gives it: de-quantized (F16 -> float32), then its
    architecture's processor (Llama's q/k order, Gemma's norm offset)."""
    from gguf import dequantize

    weights = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name).weights
    return torch.from_numpy(np.copy(weights)).float()


def _set(module: nn.Module, attribute: str, value: torch.Tensor, target: str, file: str) -> None:
    old = getattr(module, attribute)
    value = value.reshape(old.shape)
    if attribute in module._parameters:
        module._parameters[attribute] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attribute] = value


def _parameter_of(model: nn.Module, module: nn.Module) -> str:
    """The name of module's weight in model ("model.embed_tokens.weight")."""
    for name, candidate in model.named_modules():
        if candidate is module:
            return f"{name}.weight"
    raise DraftwiseError("the model's embedding is not one of its modules")


def _embed_scale(embedding: nn.Module) -> torch.Tensor | None:
    scale = getattr(embedding, "embed_scale", None)
    return None if scale is None else scale.detach().clone()


def _replace(model: nn.Module, modules: dict, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(modules[parent] if parent else model, child, module)
    modules[name] = module


def _check_complete(model: nn.Module, file: str) -> None:
    """Every parameter and buffer has a value: a tensor the file lacks is named, not left on the meta device."""
    missing = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t is not None and t.is_meta]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise DraftwiseError(f"{file}: the file has no tensor for {', '.join(missing[:3])}{more}: it is incomplete "
                             "or not a model of this architecture")

