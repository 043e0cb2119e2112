"""The backend contract (backends/base.py): every backend derives from SharedBackend, declares what it can do as data
(BackendCapabilities), has exactly the members the contract names (with the same signatures), and gives consistent
results through the same calls; asked for what it does not declare, it raises a DraftwiseError.

Every backend runs here on a tiny model: hf on a random Llama in float32, quant on the same model's linears on
4-bit blocks (QuantLinear), llamacpp on a GGUF file written from it, and the layer-skipping view over the hf one."""
from __future__ import annotations

import importlib
import inspect
import json
import pkgutil

import numpy as np
import pytest
import torch
from conftest import tiny_model, tiny_tokenizer

import draftwise.backends
from draftwise.backends.base import Backend, SharedBackend, SlotView
from draftwise.backends.capabilities import BackendCapabilities
from draftwise.backends.hf import HFBackend
from draftwise.backends.prefix_cache import PrefixCache
from draftwise.backends.registry import BACKEND_CLASSES
from draftwise.backends.skipping import DraftStack, SkippingBackend
from draftwise.errors import DraftwiseError
from draftwise.methods import BACKENDS, INTERNALS, TREES, served
from draftwise.types import TreeLayout

PREFIX = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]  # 20 ids: past min_tokens
NEW = [30, 31, 32, 33, 34]
OTHER = [40, 41, 42, 43, 44, 45, 46]

# Public members a class has beyond the contract's, each with its reason. Nothing else may be public.
ALLOWED: dict[str, dict[str, str]] = {
    "HFBackend": {
        "cache": "its SlotCache, whose buffers the tests of the cache and of the quant layers' writes read",
    },
    "SkippingBackend": {
        "target": "the backend it drafts on",
        "stack": "what the draft runs in place of the target's modules (the loading reports its kernels)",
        "skip": "the layers it passes over",
        "view": "the draft's view of a target slot (LayerSkipProposer.bind)",
    },
}
ALLOWED["QuantBackend"] = ALLOWED["HFBackend"]
SLOT_ALLOWED = {"backend": "the shared model it is a slot of", "slot": "its handle on that model's cache"}


# -- the backends ------------------------------------------------------------------------------------------------


def write_tiny_gguf(path, model, tokenizer) -> None:
    """model (a transformers Llama) and tokenizer (a byte-level BPE) as a float32 GGUF file that llama.cpp loads."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    pieces = {i: piece for piece, i in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([pieces[i] for i in range(len(pieces))])
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(pieces))])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        module = name.removesuffix(".weight")
        if module == "lm_head":
            out = "output"
        elif module.startswith("model.layers."):
            index, rest = module.removeprefix("model.layers.").split(".", 1)
            out = f"blk.{index}.{layer_names[rest]}"
        else:
            out = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}[module]
        array = tensor.detach().float().cpu().numpy()
        if out.endswith(("attn_q", "attn_k")):  # rotary halves interleaved, as llama.cpp's converter writes them
            heads = cfg.num_attention_heads if out.endswith("attn_q") else cfg.num_key_value_heads
            array = array.reshape(heads, 2, -1, array.shape[1]).swapaxes(1, 2).reshape(array.shape)
        writer.add_tensor(f"{out}.weight", np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make_hf(tmp_path):
    return HFBackend(tiny_model("llama", 0))


def make_quant(tmp_path):
    from draftwise.backends.quant import QuantBackend
    from draftwise.backends.quant_model import on_4bit

    return QuantBackend(on_4bit(tiny_model("llama", 0), progress=False))


def make_llamacpp(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'draftwise[llamacpp]')")
    from draftwise.backends.llamacpp import LlamaCppBackend

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_model("llama", 0), tiny_tokenizer())
    return LlamaCppBackend(str(path), slots=6, context=256)


def make_skipping(tmp_path):
    return SkippingBackend(HFBackend(tiny_model("llama", 0)), DraftStack(skip=(1,)))


# name -> (maker, whether a position's logits are the same bits in any call shape on this instance: the hf model
# here runs on transformers' own kernels, not the invariant one, so its rows agree within float rounding)
MAKERS = {"hf": (make_hf, False), "quant": (make_quant, True), "llamacpp": (make_llamacpp, True),
          "skipping": (make_skipping, False)}


@pytest.fixture(params=sorted(MAKERS))
def case(request, tmp_path):
    make, exact = MAKERS[request.param]
    backend = make(tmp_path)
    yield backend, exact
    backend.close()


def same(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(got, want), f"max |diff| {float((got - want).abs().max())}"
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# -- what every backend class is -----------------------------------------------------------------------------------


def _backend_classes() -> list[type]:
    """Every class defined in draftwise/backends/ that scores ragged batches (has forward_batch)."""
    found = []
    for info in pkgutil.iter_modules(draftwise.backends.__path__):
        module = importlib.import_module(f"draftwise.backends.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and callable(getattr(cls, "forward_batch", None)):
                found.append(cls)
    return found


def _slot_classes() -> list[type]:
    found = []
    for info in pkgutil.iter_modules(draftwise.backends.__path__):
        module = importlib.import_module(f"draftwise.backends.{info.name}")
        found += [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                  if cls.__module__ == module.__name__ and issubclass(cls, SlotView) and cls is not SlotView]
    return found


def test_every_backend_class_derives_from_the_contract_and_declares_what_it_can_do():
    classes = [cls for cls in _backend_classes() if cls is not SharedBackend]
    assert {cls.__name__ for cls in classes} == {"HFBackend", "QuantBackend", "LlamaCppBackend", "SkippingBackend"}
    for cls in classes:
        assert issubclass(cls, SharedBackend), f"{cls.__name__} does not derive from backends.base.SharedBackend"
        assert "capabilities" in vars(cls) and isinstance(cls.capabilities, BackendCapabilities), cls.__name__
        assert "backend_name" in vars(cls), f"{cls.__name__} names no backend_name of its own"
    assert {cls.__name__ for cls in _slot_classes()} == {"HFSlot", "LlamaSlot", "SkippingSlot"}


def test_the_quant_backend_is_a_class_of_its_own():
    from draftwise.backends.quant import QuantBackend

    assert QuantBackend.backend_name == "quant" and QuantBackend.capabilities.dtypes == ("float32",)
    with pytest.raises(DraftwiseError, match="linears are on its GGUF file's blocks"):
        QuantBackend(tiny_model("llama", 0))  # plain nn.Linear: not a quant model


def test_the_methods_table_reads_what_the_classes_declare():
    assert list(BACKENDS) == ["hf", "quant", "llamacpp"]  # the order errors list them in
    for name, cls in BACKEND_CLASSES.items():
        assert cls.backend_name == name and BACKENDS[name] == served(cls.capabilities)
    assert served(BackendCapabilities(trees=True, hidden_states=True, layer_access=True)) == {TREES, INTERNALS}
    # internals need both: hidden states (a head) and the layers (skip)
    assert served(BackendCapabilities(trees=True, hidden_states=True)) == {TREES}
    assert served(BackendCapabilities()) == frozenset()


def test_capabilities_are_frozen_data():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        HFBackend.capabilities.trees = False


# -- exactly the contract's members --------------------------------------------------------------------------------


def contract_members(contract: type) -> set[str]:
    """The public names a contract class declares: its methods, properties and annotated attributes."""
    names = set(vars(contract)) | set(getattr(contract, "__annotations__", {}))
    return {n for n in names if not n.startswith("_")}


def public_members(cls: type, instance=None) -> set[str]:
    names = {n for n in dir(cls) if not n.startswith("_")}
    if instance is not None:
        names |= {n for n in vars(instance) if not n.startswith("_")}
    return names


def member_problems(cls: type, contract: type, allowed: dict[str, str], instance=None) -> list[str]:
    """What keeps cls from having exactly contract's members with contract's signatures (besides those allowed)."""
    members, have = contract_members(contract), public_members(cls, instance)
    problems = [f"{cls.__name__}.{n}: public, but the contract does not name it" for n in sorted(have - members - set(allowed))]
    problems += [f"{cls.__name__}.{n}: named by the contract, missing" for n in sorted(members - have)]
    for name in sorted(members & have):
        ours, theirs = inspect.getattr_static(contract, name, None), inspect.getattr_static(cls, name, None)
        if inspect.isfunction(ours):
            if not inspect.isfunction(theirs):
                problems.append(f"{cls.__name__}.{name}: a method in the contract")
                continue
            want = [(p.name, p.kind, p.default) for p in inspect.signature(ours).parameters.values()]
            got = [(p.name, p.kind, p.default) for p in inspect.signature(theirs).parameters.values()]
            if got != want:
                problems.append(f"{cls.__name__}.{name}{inspect.signature(theirs)}: the contract's is "
                                f"{name}{inspect.signature(ours)}")
        elif isinstance(ours, property) and not isinstance(theirs, property):
            problems.append(f"{cls.__name__}.{name}: a property in the contract")
    return problems


def test_every_backend_has_the_contracts_members_and_no_other_public_one(case):
    backend, _ = case
    cls = type(backend)
    assert member_problems(cls, SharedBackend, ALLOWED.get(cls.__name__, {}), backend) == []
    slot = backend.open_slot()
    try:
        assert member_problems(type(slot), Backend, SLOT_ALLOWED, slot) == []
        assert isinstance(slot, Backend) and isinstance(backend.default, Backend)
        assert isinstance(backend, Backend)  # (its single-sequence methods act on its default slot)
    finally:
        slot.close()


def test_the_member_check_finds_an_extra_member_a_missing_one_and_another_signature():
    """The control: each of these is found."""

    class Extra(HFBackend):
        def peek(self):
            ...

        def forward_batch(self, rows, logits=True):  # trees and hidden left out
            ...

    problems = member_problems(Extra, SharedBackend, ALLOWED["HFBackend"])
    assert any("Extra.peek: public, but the contract does not name it" in p for p in problems)
    assert any(p.startswith("Extra.forward_batch(") for p in problems)

    class Missing(SharedBackend):  # no member implemented: it cannot be made at all
        pass

    with pytest.raises(TypeError, match="abstract"):
        Missing()
    assert any("named by the contract, missing" in p for p in member_problems(Missing, SharedBackend, {}))


# -- the same calls, consistent results -----------------------------------------------------------------------------


def test_prefill_forward_trim_and_a_ragged_batch_agree(case):
    backend, exact = case
    before = backend.open_slots
    a, b = backend.open_slot(), backend.open_slot()
    assert backend.open_slots == before + 2
    try:
        a.prefill(PREFIX)
        assert a.cache_len == len(PREFIX)
        first = a.forward(NEW)  # [5, vocab]
        assert first.shape == (len(NEW), backend.vocab_size) and first.dtype == torch.float32
        assert a.cache_len == len(PREFIX) + len(NEW)
        a.trim(len(PREFIX))
        assert a.cache_len == len(PREFIX)
        assert torch.equal(a.forward(NEW), first)  # the same call on the same cache: the same bits
        a.trim(len(PREFIX))
        b.prefill(OTHER)
        out = backend.forward_batch([(a, NEW), (b, [50, 51])])  # a ragged batch: 5 and 2 new ids
        assert [row.shape for row in out] == [(5, backend.vocab_size), (2, backend.vocab_size)]
        assert (a.cache_len, b.cache_len) == (len(PREFIX) + 5, len(OTHER) + 2)
        same(out[0], first, exact)
        a.trim(len(PREFIX))
        b.trim(len(OTHER))
        alone = b.forward([50, 51])
        same(out[1], alone, exact)
        # without logits: the cache fills, the rows are empty
        a.trim(len(PREFIX))
        empty = backend.forward_batch([(a, NEW)], logits=False)
        assert empty[0].shape == (0, backend.vocab_size) and a.cache_len == len(PREFIX) + len(NEW)
        a.append([60, 61])
        assert a.cache_len == len(PREFIX) + len(NEW) + 2
    finally:
        a.close()
        b.close()
        a.close()  # closing twice does nothing
    assert backend.open_slots == before


def test_the_default_slot_serves_the_single_sequence_methods(case):
    backend, _ = case
    backend.prefill(PREFIX)
    first = backend.forward(NEW)
    backend.trim(len(PREFIX))
    assert backend.cache_len == len(PREFIX) and torch.equal(backend.forward(NEW), first)
    backend.trim(0)


def test_a_row_past_the_context_is_refused_and_moves_nothing(case):
    backend, _ = case
    slot = backend.open_slot()
    try:
        slot.prefill(PREFIX)
        with pytest.raises(DraftwiseError, match="exceeds the model's context"):
            slot.forward([5] * (backend.max_context - len(PREFIX) + 1))
        assert slot.cache_len == len(PREFIX)
    finally:
        slot.close()


def test_trees_where_declared_refused_where_not(case):
    backend, exact = case
    slot = backend.open_slot()
    root, x, y, z = NEW[0], NEW[1], NEW[2], NEW[3]
    tree = TreeLayout.of((-1, -1))  # the root and two children: x and y, siblings
    try:
        slot.prefill(PREFIX)
        if not backend.capabilities.trees:
            with pytest.raises(DraftwiseError, match="tree"):
                backend.forward_batch([(slot, [root, x, y])], trees=[tree])
            assert slot.cache_len == len(PREFIX)
            with pytest.raises(DraftwiseError, match="tree"):
                slot.keep(len(PREFIX) + 1, [len(PREFIX) + 2])
            return
        scored = backend.forward_batch([(slot, [root, x, y])], trees=[tree])[0]  # [3, vocab]
        # y sees the root, not its sibling x: its logits are the chain root, y's
        chain = backend.open_slot()
        try:
            chain.prefill(PREFIX)
            path = chain.forward([root, y, z])  # [3, vocab]
        finally:
            chain.close()
        same(scored[2], path[1], exact)
        # keep y where a chain puts it; then z follows it as in the chain
        slot.keep(len(PREFIX) + 1, [len(PREFIX) + 2])
        slot.trim(len(PREFIX) + 2)
        same(slot.forward([z])[0], path[2], exact)
    finally:
        slot.close()


def test_hidden_states_where_declared_refused_where_not(case):
    backend, _ = case
    slot = backend.open_slot()
    try:
        slot.prefill(PREFIX)
        if not backend.capabilities.hidden_states:
            with pytest.raises(DraftwiseError, match="hidden states"):
                backend.forward_batch([(slot, NEW)], hidden=True)
            with pytest.raises(DraftwiseError, match="hidden states"):
                slot.append(NEW, hidden=True)
            assert slot.cache_len == len(PREFIX)
            return
        logits, hidden = backend.forward_batch([(slot, NEW)], hidden=True)
        assert logits[0].shape == (len(NEW), backend.vocab_size) and hidden[0].shape[0] == len(NEW)
        slot.trim(len(PREFIX))
        assert slot.append(NEW, hidden=True).shape == hidden[0].shape
    finally:
        slot.close()


def test_layer_access_where_declared_refused_where_not(case):
    backend, _ = case
    if backend.capabilities.layer_access:
        assert isinstance(backend.model, torch.nn.Module)
    else:
        with pytest.raises(DraftwiseError):
            backend.model


def test_the_prompt_cache_where_declared_refused_where_not(case):
    backend, exact = case
    cache = PrefixCache(1 << 24, min_tokens=4)
    text = PREFIX + NEW
    if not backend.capabilities.prompt_cache:
        with pytest.raises(DraftwiseError, match="prompt cache"):
            backend.attach_prompt_cache(cache, "target")
        slot = backend.open_slot()
        try:  # no prompt cache: nothing restored, nothing kept
            slot.prefill(PREFIX)
            slot.remember(PREFIX)
            assert slot.restore(text) == 0 and slot.cache_len == 0
        finally:
            slot.close()
        return
    backend.attach_prompt_cache(cache, "target")
    cold, warm = backend.open_slot(), backend.open_slot()
    try:
        cold.prefill(text)
        want = cold.forward(OTHER)
        cold.trim(len(text))
        cold.remember(text)
        assert len(cache) == 1
        assert warm.restore(text + OTHER) == len(text) and warm.cache_len == len(text)
        same(warm.forward(OTHER), want, exact)
    finally:
        cold.close()
        warm.close()
