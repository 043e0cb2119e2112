"""The quant backend: a GGUF file's own blocks (backends/gguf_weights.py) on draftwise's integer kernel
(backends/qgemm.c), exact on its own route.

Decoding is checked against the gguf package's reference dequantization, bit for bit; the kernel against a float
matmul (within the rounding of int8 activations, with a control that must fail) and against itself: a row's
result is bit-identical alone, in any batch, on any thread count, and on the scalar path of a CPU without
AVX2 or AVX-512 (every path against every other: test_kernel_isa.py). Then every method's greedy tokens equal
`none`'s on SmolLM2-135M's Q4_1 file, alone and batched."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import decode_together

from draftwise import Engine
from draftwise.backends import gguf_weights, qgemm
from draftwise.backends.qgemm import QuantLinear
from draftwise.config import GenerationConfig
from draftwise.errors import DraftwiseError

NAME = "smollm2-135m-instruct"
PROMPT = ("def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n"
          "    left = [x for x in arr if x < pivot]\n")
OTHER = "The cat sat on the mat and looked at the hat. The cat sat on the"
NEW_TOKENS = 40


def kernel_vectorized() -> bool:
    """Whether the kernel runs a vector path here (AVX-512, AVX-VNNI or AVX2; False, too, where it cannot be
    compiled: those tests fail on their own, with the compiler's message)."""
    try:
        return qgemm.vectorized()
    except DraftwiseError:
        return False


def raw_blocks(type_name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random blocks of a GGUF type [rows, bytes a row], their float16 scales set to small finite values."""
    size, values, _, _ = gguf_weights.DECODERS[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * k // values, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.02, (len(blocks), 2)).astype(np.float16).view(np.uint8).reshape(len(blocks), 4)
    if type_name == "Q6_K":
        blocks[:, 208:210] = scales[:, :2]  # d last
    else:
        blocks[:, 0:4 if type_name in ("Q4_K", "Q4_1") else 2] = scales[:, :4 if type_name in ("Q4_K", "Q4_1") else 2]
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(gguf_weights.DECODERS))
def test_decoding_gives_the_gguf_packages_own_values(type_name):
    import gguf

    raw = raw_blocks(type_name, 32, 512)
    ours = gguf_weights.decode(type_name, raw, 32, 512).dequantize()
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(32, 512)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    # control: the same bytes read as another type of the same block size do not match
    assert not np.allclose(gguf_weights.decode(type_name, raw, 32, 512).dequantize()[:, ::-1], theirs, atol=1e-4)


def test_a_type_it_does_not_read_is_refused_by_name():
    with pytest.raises(DraftwiseError, match="reads .*Q4_K.* not IQ2_XS"):
        gguf_weights.decode("IQ2_XS", np.zeros((1, 1), np.uint8), 1, 256)


def layer(type_name: str, n: int = 80, k: int = 512, seed: int = 0) -> tuple[QuantLinear, torch.Tensor]:
    blocks = gguf_weights.decode(type_name, raw_blocks(type_name, n, k, seed), n, k)
    return QuantLinear(gguf_weights.pack(blocks)), torch.from_numpy(blocks.dequantize())


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"])
def test_the_kernel_computes_the_layer_within_int8_activation_rounding(type_name):
    linear, weight = layer(type_name, n=72)  # 72: not a multiple of the 16-channel tile
    # where the minimum's integer is the scale's (Q6_K; the unit scales of Q5_0 and Q8_0) one buffer is read once
    assert (linear.mn.data_ptr() == linear.sc.data_ptr()) == (type_name in ("Q6_K", "Q5_0", "Q8_0"))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    exact = x @ weight.T
    error = lambda y: float((y - exact).norm() / exact.norm())  # noqa: E731
    assert error(linear(x)) < 0.02
    # control: a weight packed with its channels in another order is far off
    shuffled, _ = layer(type_name, n=72, seed=0)
    shuffled.q = shuffled.q.view(-1, 16).flip(0).reshape(-1).contiguous()
    assert error(shuffled(x)) > 0.2


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_a_rows_result_is_the_same_bits_alone_in_any_batch_and_on_any_thread_count(type_name):
    linear, _ = layer(type_name, n=64, k=1024)
    x = torch.randn(21, 1024, generator=torch.Generator().manual_seed(2))  # 21 rows: past a 16-row pass
    together = linear(x)
    for m in range(len(x)):
        assert torch.equal(linear(x[m:m + 1]), together[m:m + 1]), f"row {m}"
    assert torch.equal(linear(x[3:11]), together[3:11])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x), together)
    finally:
        torch.set_num_threads(threads)
    # control: an input that differs in one row changes that row only, and does change it
    other = x.clone()
    other[4] += 0.5
    changed = linear(other)
    assert not torch.equal(changed[4], together[4]) and torch.equal(changed[5:], together[5:])


@pytest.mark.skipif(not kernel_vectorized(), reason="this CPU runs the scalar path already (no AVX2 or AVX-512)")
def test_the_scalar_path_gives_the_vector_paths_bits():
    import ctypes

    lib = qgemm.library_for("scalar")  # (every path against every other: tests/test_kernel_isa.py)
    assert lib.dw_vectorized() == 0
    for type_name in ("Q4_K", "Q6_K", "Q8_0", "Q5_0"):
        linear, _ = layer(type_name, n=48, k=512)
        x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
        vector = linear(x)
        y = torch.empty(3, 48)
        status = lib.dw_linear(*map(ctypes.c_void_p, (x.data_ptr(),)), 3, 48, 512, linear.group, linear.supers,
                               linear.bits, *(ctypes.c_void_p(getattr(linear, n).data_ptr())
                                                      for n in ("q", "sc", "mn", "d", "dmin")),
                               ctypes.c_void_p(y.data_ptr()))
        assert status == 0 and torch.equal(y, vector), type_name


# ---- the backend on a real file ------------------------------------------------------------------------


def test_the_quant_backend_refuses_other_dtypes_before_loading():
    with pytest.raises(DraftwiseError, match="computes in float32 .* --dtype bfloat16 does not apply"):
        Engine.from_pretrained("no-such-model", method="none", backend="quant", dtype="bfloat16")


@functools.lru_cache(maxsize=None)
def engine(method: str) -> Engine:
    return Engine.from_pretrained(NAME, draft=NAME if method in ("draft", "hybrid", "hybrid-tree") else None,
                                  method=method, backend="quant", progress=False)


def ids(text: str) -> list[int]:
    return engine("none").tokenizer(text)["input_ids"]


@functools.lru_cache(maxsize=None)
def baseline(prompt: str) -> tuple[int, ...]:
    return tuple(engine("none").generate(ids(prompt), max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids)


@pytest.mark.real_model
def test_the_models_linears_run_on_the_files_blocks():
    model = engine("none").target.model
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 30 * 7 + 1  # every projection of the 30 layers, and the output layer
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert engine("none").speed_paths["backend"] == "quant"
    assert engine("none").speed_paths["target_kernels"] == {"q4": 210, "q8": 1}  # Q4_1 layers, Q8_0 output layer


# Without AVX2 or AVX-512 the kernel runs its scalar path, about 20 times slower: these runs would take minutes. That
# path's bits equal the vector path's (test_the_scalar_path_gives_the_vector_paths_bits, where both run).
@pytest.mark.real_model
@pytest.mark.skipif(not kernel_vectorized(), reason="the scalar path (no AVX2, no AVX-512) is too slow for real models")
@pytest.mark.parametrize("method", ["lookup", "lookup-tree", "draft", "hybrid-tree", "skip"])
def test_every_method_gives_the_tokens_of_none_alone_and_batched(method):
    eng = engine(method)
    for prompt in (PROMPT, OTHER):
        for k in (1, 4):
            got = eng.generate(ids(prompt), max_new_tokens=NEW_TOKENS, ignore_eos=True, num_draft_tokens=k,
                               adaptive=False).token_ids  # (a fixed k: every round drafts)
            assert tuple(got) == baseline(prompt), f"{method}, k={k}, alone"
    cfg = GenerationConfig.from_options(max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True, method=method)
    seqs = decode_together(eng, [ids(PROMPT), ids(OTHER)], cfg)
    got = [tuple(seq.context[len(ids(p)):]) for seq, p in zip(seqs, (PROMPT, OTHER))]
    assert got == [baseline(PROMPT), baseline(OTHER)], f"{method}, batched"


def logits_by_call_shape(backend) -> dict[str, torch.Tensor]:
    """The logits of the same 5 positions (after a 20-token prefix) computed by one-token steps, one 5-token pass,
    and as a row of a ragged batch beside a shorter one."""
    text = ids(PROMPT)
    prefix, new = text[:20], text[20:25]
    steps, chunk, batched, other = (backend.open_slot() for _ in range(4))
    try:
        steps.prefill(prefix)
        shapes = {"one-token steps": torch.cat([steps.forward([t]) for t in new])}
        chunk.prefill(prefix)
        shapes["one 5-token pass"] = chunk.forward(new)
        batched.prefill(prefix)
        other.prefill(ids(OTHER))
        shapes["a row of a ragged batch"] = backend.forward_batch([(batched, new), (other, ids(" the dog")[:2])])[0]
    finally:
        for view in (steps, chunk, batched, other):
            view.close()
    return shapes


def sdpa(query, key, value, visible, scale):
    """transformers' kernel in the per-query attention's place: [B, n, H, d]."""
    group = query.shape[1] // key.shape[1]
    mask = visible.bool()[:, None]  # [B, 1, n, L]
    out = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(group, 1),
                                                           value.repeat_interleave(group, 1), attn_mask=mask,
                                                           scale=scale)
    return out.transpose(1, 2).contiguous()


@pytest.mark.real_model
def test_a_positions_logits_do_not_depend_on_the_call_that_computed_them(monkeypatch):
    from draftwise.backends import quant_layers

    backend = engine("none").target
    shapes = logits_by_call_shape(backend)
    first = shapes["one 5-token pass"]
    for name, logits in shapes.items():
        assert torch.equal(logits, first), f"{name}: max |diff| {float((logits - first).abs().max())}"
    # control: on the layers' parts, with PyTorch's SDPA in the per-query attention's place, the same positions
    # differ between shapes
    monkeypatch.setattr(quant_layers._OneCall, "struct", lambda self, layer: None)
    monkeypatch.setattr(quant_layers, "attention", sdpa)
    shapes = logits_by_call_shape(backend)
    assert not all(torch.equal(logits, shapes["one 5-token pass"]) for logits in shapes.values())


def logits_of_ragged_batches(backend) -> list[torch.Tensor]:
    """Logits of two ragged batches over three slots, the second over rows that are not next to each other."""
    a, b, c = (backend.open_slot() for _ in range(3))
    try:
        for view, prompt in ((a, PROMPT), (b, OTHER), (c, " the dog")):
            view.prefill(ids(prompt))
        first = backend.forward_batch([(a, [5, 6, 7]), (b, [8, 9, 10, 11, 12]), (c, [13])])
        second = backend.forward_batch([(c, [14, 15]), (a, [16])])  # rows 2 and 0
        return first + second + [b.forward([17])]
    finally:
        for view in (a, b, c):
            view.close()


def count_layer_calls(monkeypatch) -> list:
    """Grows by one at each layer the kernel runs in one call, whichever route made the call (a layer alone, or the
    whole stack in one: its count of layers)."""
    calls, lib = [], qgemm.library()
    layer, stack = lib.dw_decoder_layer, lib.dw_decoder_stack
    monkeypatch.setattr(lib, "dw_decoder_layer", lambda *a: calls.append(1) or layer(*a))
    monkeypatch.setattr(lib, "dw_decoder_stack", lambda *a: calls.extend([1] * a[1]) or stack(*a))
    return calls


@pytest.mark.real_model
def test_a_layer_in_one_call_gives_the_bits_of_its_parts_called_one_by_one(monkeypatch):
    from draftwise.backends import quant_layers

    backend = engine("none").target
    layers = backend.model.model.layers
    assert all(isinstance(layer, quant_layers.OneCallLayer) for layer in layers)
    calls = count_layer_calls(monkeypatch)
    fused = logits_of_ragged_batches(backend)
    assert len(calls) == 6 * len(layers)  # three prefills, three passes
    with monkeypatch.context() as patch:
        patch.setattr(quant_layers._OneCall, "struct", lambda self, layer: None)
        parts = logits_of_ragged_batches(backend)
    assert len(calls) == 6 * len(layers)
    for got, want in zip(fused, parts):
        assert torch.equal(got, want), f"max |diff| {float((got - want).abs().max())}"
    # control: a layer whose two norms are swapped in its one call gives other logits
    middle = layers[len(layers) // 2]
    struct = middle._one_call.struct(middle)
    struct.norm1, struct.norm2 = struct.norm2, struct.norm1
    try:
        assert not torch.equal(logits_of_ragged_batches(backend)[0], parts[0])
    finally:
        middle._one_call.__init__()


@pytest.mark.real_model
def test_the_loop_of_one_call_layers_gives_the_bits_of_transformers_forward(monkeypatch):
    from draftwise.backends import hf, quant_layers

    backend = engine("none").target
    layers = backend.model.model.layers
    module_calls = []
    one_call = quant_layers.OneCallLayer._in_one_call
    monkeypatch.setattr(quant_layers.OneCallLayer, "_in_one_call", lambda *a: module_calls.append(1) or one_call(*a))
    kernel_calls = count_layer_calls(monkeypatch)
    looped = logits_of_ragged_batches(backend)
    assert (len(module_calls), len(kernel_calls)) == (0, 6 * len(layers))  # the loop, past the layers' modules
    with monkeypatch.context() as patch:  # transformers' forward over the same one-call layers
        patch.setattr(hf, "layer_structs", lambda model: None)
        routed = logits_of_ragged_batches(backend)
    assert len(module_calls) == 6 * len(layers)
    for got, want in zip(looped, routed):
        assert torch.equal(got, want), f"max |diff| {float((got - want).abs().max())}"
    # control: the loop with two layers in each other's place gives other logits
    order = hf.layer_structs(backend.model)
    order[3], order[4] = order[4], order[3]
    monkeypatch.setattr(hf, "layer_structs", lambda model: order)
    assert not torch.equal(logits_of_ragged_batches(backend)[0], routed[0])


@pytest.mark.real_model
def test_greedy_tokens_and_hidden_states_are_those_of_transformers_forward(monkeypatch):
    from draftwise.backends import hf

    eng = engine("none")
    view = eng.target.open_slot()
    try:
        view.prefill(ids(PROMPT))
        # hidden states asked for: hooks on the decoder, so transformers' forward runs (its logits, the loop's bits)
        (logits,), (hidden,) = eng.target.forward_batch([(view, [5, 6])], hidden=True)
        view.trim(len(ids(PROMPT)))
        assert torch.equal(logits, view.forward([5, 6]))
        assert hidden.shape == (2, eng.target.model.config.hidden_size)
    finally:
        view.close()
    looped = baseline(OTHER)
    monkeypatch.setattr(hf, "layer_structs", lambda model: None)
    assert tuple(eng.generate(ids(OTHER), max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids) == looped


@pytest.mark.real_model
def test_a_layer_in_one_call_refuses_a_cache_it_would_write_wrongly():
    backend = engine("none").target
    view = backend.open_slot()
    saved = None
    try:
        view.prefill(ids(PROMPT)[:4])
        saved = backend.cache.keys[0]
        backend.cache.keys[0] = saved.to(torch.bfloat16)  # float32 rows written into it would be garbage
        with pytest.raises(DraftwiseError, match="writes a float32 cache; layer 0's holds torch.bfloat16"):
            view.forward([5])
        assert view.cache_len == 4  # the failed pass moved nothing
    finally:
        if saved is not None:
            backend.cache.keys[0] = saved
        view.close()


# ---- a feature head on the quant target ------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def quant_head(root: str) -> Path:
    """A small head trained on the quant target's own features, captured as a server captures them while it answers
    (serve/feature_capture.py): the route a head for this backend takes."""
    from draftwise.serve.feature_capture import FeatureCapture, captured_files
    from draftwise.train.head import TrainConfig, train_head

    eng = engine("none")
    capture = FeatureCapture(Path(root) / "captured", max_bytes=1 << 30)
    cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    eng.feature_sink = capture.observe
    try:
        for i, prompt in enumerate([PROMPT, OTHER, PROMPT[:60], OTHER[:30]] * 2):  # (the latest fifth: held out)
            seq = decode_together(eng, [ids(prompt)], cfg)[0]
            capture.finish(seq, f"req-{i}", seq.finish)
    finally:
        eng.feature_sink = None
        capture.close()
    tiny = TrainConfig(seq_len=128, epochs=6, lr=5e-3, warmup_steps=5, intermediate_size=128, readout=512)
    train_head(eng.target.model, eng.tokenizer, Path(root) / "head", tiny, progress=False, log=lambda _: None,
               captured=captured_files(Path(root) / "captured"))
    return Path(root) / "head"


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_a_packed_layer_gives_back_the_float_rows_its_blocks_stand_for(type_name):
    """What a head's readout reads on the quant backend, where the output layer keeps no float copy."""
    linear, weight = layer(type_name, n=72)  # 72: padded to 80 channels in the tiles
    assert torch.equal(linear.dequantized(), weight)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(linear(x), x @ weight.T, rtol=0.02, atol=0.02 * float((x @ weight.T).abs().max()))
    # control: another layer's blocks give other rows
    assert not torch.equal(layer(type_name, n=72, seed=1)[0].dequantized(), weight)


def test_the_head_refuses_an_output_layer_without_float_rows():
    from draftwise.proposers.head_model import output_weight

    model = torch.nn.Module()
    model.get_output_embeddings = lambda: torch.nn.Module()  # (a layer repacked for a kernel: no weight)
    model.config = type("Config", (), {"get_text_config": lambda self: type("Text", (), {})()})()
    with pytest.raises(DraftwiseError, match="no plain weight .*give the head the model as loaded"):
        output_weight(model)


@pytest.mark.real_model
@pytest.mark.skipif(not kernel_vectorized(), reason="the scalar path (no AVX2, no AVX-512) is too slow for real models")
@pytest.mark.parametrize("method", ["head", "hybrid-head"])
def test_a_head_on_the_quant_target_gives_the_tokens_of_none_alone_and_batched(method, tmp_path_factory):
    folder = quant_head(str(tmp_path_factory.getbasetemp() / "quant-head"))
    eng = Engine.from_pretrained(NAME, method=method, head=str(folder), backend="quant", progress=False)
    assert eng.speed_paths["backend"] == "quant"
    accepted = 0
    for prompt in (PROMPT, OTHER):
        for k in (1, 4):
            result = eng.generate(ids(prompt), max_new_tokens=NEW_TOKENS, ignore_eos=True, num_draft_tokens=k,
                                  adaptive=False)
            assert tuple(result.token_ids) == baseline(prompt), f"{method}, k={k}, alone"
            accepted += result.stats.accepted
    assert accepted > 0  # the head's guesses were kept, not only offered and refused
    cfg = GenerationConfig.from_options(max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True, method=method)
    seqs = decode_together(eng, [ids(PROMPT), ids(OTHER)], cfg)
    got = [tuple(seq.context[len(ids(p)):]) for seq, p in zip(seqs, (PROMPT, OTHER))]
    assert got == [baseline(PROMPT), baseline(OTHER)], f"{method}, batched"


@pytest.mark.parametrize("bits,most_error", [(4, 0.12), (2, 0.5)])
def test_a_drafts_low_bit_copy_stays_close_to_its_float_weight(bits, most_error):
    weight = torch.randn(48, 896, generator=torch.Generator().manual_seed(4)).numpy()  # 896: 28 groups, 7 a super
    blocks = gguf_weights.quantize_draft(weight, bits)
    assert blocks.bits == bits and blocks.supers == 7 and int(blocks.q.max()) == (1 << bits) - 1
    error = np.abs(blocks.dequantize() - weight).mean() / np.abs(weight).mean()
    assert error < most_error
    # control: the same levels with the scales of another channel are far off
    assert np.abs(blocks.rows(np.roll(np.arange(48), 1)).dequantize() - weight).mean() / np.abs(weight).mean() > 0.5
    # the kernel's layout holds them exactly, and its product is the float one up to the activations' rounding
    linear = QuantLinear(gguf_weights.pack(blocks))
    assert torch.equal(linear.dequantized(), torch.from_numpy(blocks.dequantize()))
    x = torch.randn(3, 896, generator=torch.Generator().manual_seed(0))
    want = x @ torch.from_numpy(blocks.dequantize()).T
    assert torch.allclose(linear(x), want, rtol=0.02, atol=0.02 * float(want.abs().max()))


def test_a_draft_refuses_a_width_it_has_no_blocks_for():
    with pytest.raises(DraftwiseError, match="take 4 or 2 bits, not 3"):
        gguf_weights.quantize_draft(np.zeros((16, 64), dtype=np.float32), 3)


@pytest.mark.real_model
def test_a_draft_beside_a_quant_target_runs_on_4bit_blocks_with_its_readout_at_most_the_quant_rows():
    from draftwise.loading import QUANT_DRAFT_VOCAB

    eng = engine("draft")
    draft, target = eng.proposer.backend.model, eng.target.model
    # SmolLM2's Q4_1 layers as they are; the output layer, on the Q8_0 embedding's rows, re-quantized to 4 bits
    assert {m.bits for m in draft.modules() if isinstance(m, QuantLinear)} == {4}
    assert not any(isinstance(m, torch.nn.Linear) for m in draft.modules())
    # over the lowest QUANT_DRAFT_VOCAB ids: all of SmolLM2's 49,152 (a wider vocabulary is cut: test_gguf_draft.py)
    assert draft.get_output_embeddings().out_features == min(eng.target.vocab_size, QUANT_DRAFT_VOCAB)
    assert eng.speed_paths["backend"] == "quant" and eng.speed_paths["draft_kernels"] == {"q4": 211}
    # the target's own file as its draft: its 4-bit linears shared, the target's output layer still its file's
    owned = dict(target.named_modules())
    shared = [name for name, m in draft.named_modules() if isinstance(m, QuantLinear) and owned.get(name) is m]
    assert len(shared) == 210 and target.get_output_embeddings().bits == 8


# ---- sampling: the target's own distribution on this route ------------------------------------------------

SAMPLED_RUNS = 800


@functools.lru_cache(maxsize=None)
def tiny_quant(scale: float):
    """A tiny random Qwen2 model (logits scaled by `scale`) on 4-bit blocks and the quant backend's layers: the same
    modules a GGUF file's blocks run on."""
    from conftest import tiny_model

    from draftwise.backends.quant_model import on_4bit

    model = tiny_model("qwen2", 0)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return on_4bit(model, progress=False)


@functools.lru_cache(maxsize=None)
def loop_prompt(mid: bool) -> tuple[int, ...]:
    """The quant target's own greedy continuation of a short text, which loops (lookup then finds matches);
    mid: one token shorter, so that the hybrid's first round is a lookup round."""
    from conftest import tiny_tokenizer

    base = tiny_tokenizer()("The quick brown fox")["input_ids"]
    ids = list(base)
    with torch.no_grad():
        for _ in range(30):
            ids.append(int(tiny_quant(2.5)(torch.tensor([ids])).logits[0, -1].argmax()))
    return tuple(ids[:-1] if mid else ids)


@functools.lru_cache(maxsize=None)
def exact_quant_pairs(temperature: float, mid: bool) -> dict:
    """P(t1, t2) from the quant target's own forward passes."""
    from draftwise.config import SamplingConfig
    from draftwise.sampling import logits_to_probs

    cfg, ids, model = SamplingConfig(temperature=temperature), list(loop_prompt(mid)), tiny_quant(2.5)
    with torch.no_grad():
        first = logits_to_probs(model(torch.tensor([ids])).logits[0, -1], cfg)
        table = {}
        for t1 in torch.nonzero(first > 1e-4).flatten().tolist():
            second = logits_to_probs(model(torch.tensor([ids + [t1]])).logits[0, -1], cfg)
            for t2 in torch.nonzero(second * first[t1] > 1e-4).flatten().tolist():
                table[(t1, t2)] = float(first[t1] * second[t2])
    return table


@functools.lru_cache(maxsize=None)
def quant_sampled_pairs(method: str, temperature: float, mid: bool) -> tuple[list, int, int]:
    from conftest import tiny_model, tiny_tokenizer

    from draftwise.loading import QUANT_ASSEMBLY

    draft = None
    if method in ("draft", "hybrid"):  # the target at another temperature: agrees often, not always
        draft = tiny_model("qwen2", 0)
        with torch.no_grad():
            draft.lm_head.weight.mul_(1.5)
    eng = Engine.from_models(tiny_quant(2.5), tiny_tokenizer(), draft_model=draft, method=method, **QUANT_ASSEMBLY)
    pairs, kept, proposed = [], 0, 0
    for seed in range(SAMPLED_RUNS):
        # (a fixed k: every round drafts, so that both keeping and rejecting are exercised)
        result = eng.generate(list(loop_prompt(mid)), max_new_tokens=3, num_draft_tokens=2, temperature=temperature,
                              seed=seed, ignore_eos=True, adaptive=False)
        pairs.append(tuple(result.token_ids[:2]))
        kept, proposed = kept + result.stats.accepted, proposed + result.stats.proposed
    return pairs, kept, proposed - kept


@pytest.mark.parametrize("method,mid", [("draft", False), ("lookup", False), ("hybrid", True)])
def test_sampled_tokens_follow_the_quant_targets_distribution(method, mid):
    from stats_helpers import fit_pvalue

    pairs, kept, rejected = quant_sampled_pairs(method, 1.0, mid)
    assert fit_pvalue(pairs, exact_quant_pairs(1.0, mid)) > 1e-3
    assert kept >= SAMPLED_RUNS // 8 and rejected >= SAMPLED_RUNS // 10  # both paths, many times
    # control: the same samples are far from the distribution at another temperature
    assert fit_pvalue(pairs, exact_quant_pairs(0.6, mid)) < 1e-6


def test_auto_picks_quant_only_where_it_runs_fast_and_exact(monkeypatch, tmp_path):
    from draftwise.loading import auto_backend

    monkeypatch.setattr(qgemm, "fast_here", lambda: True)
    # refused before any model is resolved: another device, an explicit dtype
    assert auto_backend("no-such-model", None, "none", device="cuda") == "hf"
    assert auto_backend("no-such-model", None, "none", dtype="bfloat16") == "hf"
    assert auto_backend("no-such-model", None, "none", batch_invariant=False) == "hf"  # timed kernels: hf's only
    monkeypatch.setattr(qgemm, "fast_here", lambda: False)
    assert auto_backend("no-such-model", None, "none") == "hf"  # (no AVX2 + FMA here, or no compiler)
    monkeypatch.setattr(qgemm, "fast_here", lambda: True)
    with pytest.raises(DraftwiseError, match="no-such-model"):  # a typo is still an error, not a silent hf
        auto_backend("no-such-model", None, "none")


@pytest.mark.real_model
def test_auto_picks_quant_for_a_model_whose_gguf_is_in_the_store(monkeypatch):
    from draftwise.loading import auto_backend

    monkeypatch.setattr(qgemm, "fast_here", lambda: True)
    assert auto_backend(NAME, NAME, "hybrid") == "quant"
    monkeypatch.setattr(qgemm, "fast_here", lambda: False)
    assert auto_backend(NAME, NAME, "hybrid") == "hf"
