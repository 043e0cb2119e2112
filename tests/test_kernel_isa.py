"""The kernel's paths per instruction set (backends/qgemm.c: avx512, avxvnni, avx2, scalar) give the same bits.

Each path this CPU runs is checked against the fastest one here: a layer's output on every GGUF type and on inputs
that drive AVX2's int16 sums to their largest, attention and the RMS norm, a tiny quant model's logits (the layers'
parts and the whole-layer call), and every method's greedy tokens, equal to `none`'s on each path and across paths.
The choice of path by DRAFTWISE_KERNEL_ISA is checked in a fresh process, and its refusals by their messages. The
control: the AVX2 path built to sum in another order (-DDW_TEST_OTHER_ORDER) must give other bits."""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import decode_together, tiny_model, tiny_tokenizer
from test_quant_backend import layer, raw_blocks, tiny_quant

from draftwise import Engine
from draftwise.backends import gguf_weights, qgemm
from draftwise.config import GenerationConfig
from draftwise.errors import DraftwiseError


def paths_here() -> tuple[str, ...]:
    try:
        qgemm.compiler()
    except DraftwiseError:
        return ()
    return qgemm.isas_here()


HERE = paths_here()
FASTEST = HERE[0] if HERE else None
OTHERS = HERE[1:]
needs_two = pytest.mark.skipif(len(HERE) < 2, reason="this CPU (or a missing compiler) runs one path of the kernel")


@contextmanager
def on_path(isa: str):
    """The process's kernel on one path, as DRAFTWISE_KERNEL_ISA chooses it (then back as it was)."""
    before = os.environ.get(qgemm.ISA_VARIABLE)
    os.environ[qgemm.ISA_VARIABLE] = isa
    qgemm.library.cache_clear()
    try:
        assert qgemm.kernel_isa() == isa
        yield
    finally:
        if before is None:
            os.environ.pop(qgemm.ISA_VARIABLE, None)
        else:
            os.environ[qgemm.ISA_VARIABLE] = before
        qgemm.library.cache_clear()


def linear_on(lib: ctypes.CDLL, linear, x: torch.Tensor) -> torch.Tensor:
    """dw_linear of one library: [rows, padded out]."""
    y = torch.empty(len(x), linear.padded_out)
    status = lib.dw_linear(ctypes.c_void_p(x.data_ptr()), len(x), linear.padded_out, linear.in_features, linear.group,
                           linear.supers, linear.bits,
                           *(ctypes.c_void_p(getattr(linear, n).data_ptr()) for n in ("q", "sc", "mn", "d", "dmin")),
                           ctypes.c_void_p(y.data_ptr()))
    assert status == 0
    return y


def attention_on(lib: ctypes.CDLL, query, key, value, visible, scale) -> torch.Tensor:
    batch, heads, n, dim = query.shape
    out = torch.empty(batch, n, heads, dim)
    lib.dw_attention.argtypes = [ctypes.c_void_p, *[ctypes.c_long] * 3] * 3 + [ctypes.c_void_p, *[ctypes.c_int] * 6,
                                                                               ctypes.c_float, ctypes.c_void_p]
    strides = [s for t in (query, key, value) for s in (t.data_ptr(), *t.stride()[:3])]
    status = lib.dw_attention(*strides, visible.data_ptr(), batch, heads, key.shape[1], n, key.shape[2], dim, scale,
                              out.data_ptr())
    assert status == 0
    return out


def attention_inputs(dim: int, seed: int = 0, keys: int = 37, spread: float = 1.0, heads: int = 6):
    """Grouped-query attention over a ragged mask: 2 sequences, `heads` query heads on 2 key heads, 5 queries, 37 keys
    (two blocks of 16 keys scored at once, then 5 one by one). spread scales the queries: the softmax's exp over a
    wider range of scores."""
    g = torch.Generator().manual_seed(seed)
    query, key, value = (torch.randn(2, h, n, dim, generator=g) for h, n in ((heads, 5), (2, keys), (2, keys)))
    query = query * spread
    visible = (torch.rand(2, 5, keys, generator=g) > 0.3).to(torch.uint8).contiguous()
    visible[1, 2] = 0  # a query that sees nothing: zeros
    return query, key, value, visible, dim ** -0.5


# ---- the pieces, each path's library side by side ---------------------------------------------------------


@needs_two
@pytest.mark.parametrize("isa", OTHERS)
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"])
def test_a_layers_output_is_the_same_bits_on_every_path(isa, type_name):
    linear, _ = layer(type_name, n=48, k=1024)
    # a pass of 1 to 16 rows and past one; the 256-bit tile keeps both halves' values up to 2 rows, one half's from 3
    for rows in (1, 2, 3, 16, 21):
        x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows)) * 3
        want = linear_on(qgemm.library_for(FASTEST), linear, x)
        got = linear_on(qgemm.library_for(isa), linear, x)
        assert torch.equal(got, want), f"{isa} vs {FASTEST}, {rows} rows: max |diff| {float((got - want).abs().max())}"


@needs_two
@pytest.mark.parametrize("isa", OTHERS)
@pytest.mark.parametrize("group", [16, 32])
def test_a_2bit_drafts_layer_is_the_same_bits_on_every_path(isa, group):
    weight = np.random.default_rng(group).standard_normal((48, 1024)).astype(np.float32)
    linear = qgemm.QuantLinear(gguf_weights.pack(gguf_weights.quantize_draft(weight, 2, group=group)))
    assert linear.bits == 2 and linear.group == group
    for rows in (1, 2, 3, 16, 21):
        x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows)) * 3
        want = linear_on(qgemm.library_for(FASTEST), linear, x)
        got = linear_on(qgemm.library_for(isa), linear, x)
        assert torch.equal(got, want), f"{isa} vs {FASTEST}, {rows} rows: max |diff| {float((got - want).abs().max())}"


@needs_two
@pytest.mark.parametrize("isa", OTHERS)
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0"])
def test_the_largest_int16_sums_of_avx2_stay_exact(isa, type_name):
    """Every stored value at its largest (15, 63, 255) and every activation at +-127 in a group: AVX2's vpmaddubsw
    pairs and the int16 sums after them reach their largest (30480, 32004, and 8-bit values split into nibbles);
    a saturation anywhere would change the output."""
    size, values, _, _ = gguf_weights.DECODERS[type_name]
    raw = raw_blocks(type_name, 32, 512)
    full = raw.reshape(-1, size)
    keep = {"Q6_K": slice(208, 210), "Q4_K": slice(0, 4), "Q8_0": slice(0, 2)}[type_name]
    scales = full[:, keep].copy()
    full[:] = 0x7F if type_name == "Q8_0" else 0xFF  # Q8_0: int8 127, stored as 255 (its offset of 128)
    full[:, keep] = scales
    linear = qgemm.QuantLinear(gguf_weights.pack(gguf_weights.decode(type_name, raw, 32, 512)))
    assert int(linear.q.max()) == 255  # every nibble (and byte) at its top
    ones = torch.ones(4, 512)
    ones[1] = -1.0
    ones[2, ::2] = -1.0  # mixed signs
    ones[3] = torch.linspace(-1, 1, 512)
    want = linear_on(qgemm.library_for(FASTEST), linear, ones)
    assert torch.equal(linear_on(qgemm.library_for(isa), linear, ones), want), isa


@needs_two
@pytest.mark.parametrize("isa", OTHERS)
@pytest.mark.parametrize("dim", [16, 40, 64, 128, 200])  # 40: a tail past the 16 lanes; 128 and 200: a value pass
# of eight full registers (200: then one with a tail)
@pytest.mark.parametrize("heads", [6, 14])  # groups of 3 query heads on each key head, and of 7 (the 0.5B draft's)
def test_attention_and_the_norm_are_the_same_bits_on_every_path(isa, dim, heads):
    inputs = attention_inputs(dim, heads=heads)
    want = attention_on(qgemm.library_for(FASTEST), *inputs)
    got = attention_on(qgemm.library_for(isa), *inputs)
    assert torch.equal(got, want), f"max |diff| {float((got - want).abs().max())}"
    assert torch.equal(got[1, 2], torch.zeros_like(got[1, 2]))
    # Many keys over a wide range of scores: the vector exp and maximum (8 or 16 lanes) against the scalar ones.
    long = attention_inputs(dim, seed=1, keys=509, spread=3.0, heads=heads)
    assert torch.equal(attention_on(qgemm.library_for(isa), *long), attention_on(qgemm.library_for(FASTEST), *long))
    x, weight = torch.randn(7, dim * 3), torch.rand(dim * 3)
    normed = []
    for lib in (qgemm.library_for(FASTEST), qgemm.library_for(isa)):
        out = torch.empty_like(x)
        lib.dw_rmsnorm(ctypes.c_void_p(x.data_ptr()), 7, dim * 3, ctypes.c_void_p(weight.data_ptr()),
                       ctypes.c_float(1e-6), ctypes.c_void_p(out.data_ptr()))
        normed.append(out)
    assert torch.equal(*normed)


def prefill_inputs(dim: int, heads: int, n: int = 40, past: int = 9, seed: int = 2):
    """One sequence's causal prefill of n tokens after `past` cached keys (tiles of 16 tokens that reach different
    keys), then the same call with a token tree's ragged rows: query [1, heads, n, d], keys [1, 2, past + n, d]."""
    g = torch.Generator().manual_seed(seed)
    keys = past + n
    query, key, value = (torch.randn(1, h, m, dim, generator=g) for h, m in ((heads, n), (2, keys), (2, keys)))
    causal = torch.ones(keys, keys, dtype=torch.uint8).tril()[past:].unsqueeze(0).contiguous()  # [1, n, keys]
    tree = causal.clone()
    tree[0, :, past:] &= (torch.rand(n, n, generator=g) > 0.4).to(torch.uint8) | torch.eye(n, dtype=torch.uint8)
    tree[0, 7, :] = 0  # a row that sees nothing: zeros
    return query, key, value, (causal, tree), dim ** -0.5


def each_query_alone(lib, query, key, value, visible, scale) -> torch.Tensor:
    """The call token by token: each query with its own row of the mask, over the same keys."""
    return torch.cat([attention_on(lib, query[:, :, t:t + 1].contiguous(), key, value,
                                   visible[:, t:t + 1].contiguous(), scale) for t in range(query.shape[2])], dim=1)


@pytest.mark.parametrize("isa", HERE)
@pytest.mark.parametrize("dim", [40, 64, 128])  # 40: weighed query by query; 64 and 128: a token's heads together
@pytest.mark.parametrize("heads", [12, 14, 24])  # groups of 6 (the 1.5B's), 7 (the 0.5B's), 12 (two passes)
def test_a_prefills_attention_is_each_query_alone_on_every_path(isa, dim, heads):
    """A prefill's queries are tiled 16 tokens at a time, their keys past the last visible one skipped and a token's
    heads weighed together: each query's bits are still those it has alone (and those of the fastest path)."""
    query, key, value, masks, scale = prefill_inputs(dim, heads)
    lib = qgemm.library_for(isa)
    for visible in masks:
        together = attention_on(lib, query, key, value, visible, scale)
        assert torch.equal(together, each_query_alone(lib, query, key, value, visible, scale))
        assert torch.equal(together, attention_on(qgemm.library_for(FASTEST), query, key, value, visible, scale))
    assert torch.equal(together[0, 7], torch.zeros_like(together[0, 7]))
    # The control: the same sums with the keys in the other order round to other bits, so the comparisons above
    # would see a reordering.
    flipped = [t.flip(2).contiguous() for t in (key, value)]
    reordered = attention_on(lib, query, *flipped, masks[0].flip(2).contiguous(), scale)
    want = attention_on(lib, query, key, value, masks[0], scale)
    assert not torch.equal(reordered, want) and torch.allclose(reordered, want, rtol=1e-4, atol=1e-5)


def mlp_on(lib: ctypes.CDLL, gate, up, down, x: torch.Tensor) -> torch.Tensor:
    """dw_mlp of one library: down(silu(gate(x)) * up(x)) [rows, down's padded out]."""
    out = torch.empty(len(x), down.padded_out)
    status = lib.dw_mlp(x.data_ptr(), len(x), *(ctypes.byref(w.struct()) for w in (gate, up, down)), out.data_ptr())
    assert status == 0
    return out


@needs_two
@pytest.mark.parametrize("isa", OTHERS)
def test_the_mlp_is_the_same_bits_on_every_path(isa):
    """The gated MLP's SiLU product runs on 16, 8 or 1 lanes by path: the same bits, over gate values wide enough to
    reach exp's clamps (scaled inputs) and at +-0."""
    gate, _ = layer("Q4_K", n=96, k=512, seed=1)
    up, _ = layer("Q4_K", n=96, k=512, seed=2)
    down, _ = layer("Q8_0", n=512, k=96, seed=3)
    for rows, spread in ((1, 1.0), (3, 40.0), (5, 4000.0)):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * spread
        x[0, :32] = 0.0
        want = mlp_on(qgemm.library_for(FASTEST), gate, up, down, x)
        got = mlp_on(qgemm.library_for(isa), gate, up, down, x)
        assert torch.equal(got, want), f"{isa} vs {FASTEST}, {rows} rows: max |diff| {float((got - want).abs().max())}"


# ---- a model on each path, chosen as a user chooses it ------------------------------------------------------

TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
NEW_TOKENS = 24


def model_logits() -> dict[str, torch.Tensor]:
    """The tiny quant model's logits on the path in use: its parts one by one (a plain forward), and its layers in
    one call each (the backend's slots: a prefill, then a 5-token pass)."""
    from draftwise.loading import QUANT_ASSEMBLY

    ids = tiny_tokenizer()(TEXT)["input_ids"]
    with torch.no_grad():
        parts = tiny_quant(2.5)(torch.tensor([ids])).logits[0]
    backend = Engine.from_models(tiny_quant(2.5), tiny_tokenizer(), method="none", **QUANT_ASSEMBLY).target
    view = backend.open_slot()
    try:
        view.prefill(ids[:-5])
        one_call = view.forward(ids[-5:])
    finally:
        view.close()
    return {"parts": parts, "one call": one_call}


def digest(logits: dict[str, torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for _, t in sorted(logits.items()))).hexdigest()


@lru_cache(maxsize=None)
def logits_on(isa: str) -> dict[str, torch.Tensor]:
    with on_path(isa):
        return model_logits()


@needs_two
@pytest.mark.parametrize("isa", OTHERS)
def test_a_tiny_quant_models_logits_are_the_same_bits_on_every_path(isa):
    want, got = logits_on(FASTEST), logits_on(isa)
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: max |diff| {float((got[name] - want[name]).abs().max())}"


SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import test_kernel_isa as t
from draftwise.backends import qgemm
from draftwise.loading import QUANT_ASSEMBLY
from draftwise import Engine
from conftest import tiny_tokenizer
eng = Engine.from_models(t.tiny_quant(2.5), tiny_tokenizer(), method="none", **QUANT_ASSEMBLY)
print(json.dumps({{"isa": qgemm.kernel_isa(), "speed_paths": eng.speed_paths.get("kernel_isa"),
                  "digest": t.digest(t.model_logits())}}))
"""


@needs_two
def test_the_environment_variable_chooses_the_path_in_a_fresh_process():
    """What a user does to measure the AVX2 path on an AVX-512 machine: the path is chosen, named in speed_paths,
    and its logits are the fastest path's bits."""
    import json

    isa = "avx2" if "avx2" in OTHERS else OTHERS[0]
    env = {**os.environ, qgemm.ISA_VARIABLE: isa,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=str(Path(__file__).parent))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["isa"] == report["speed_paths"] == isa
    assert report["digest"] == digest(logits_on(FASTEST))


METHODS = ("none", "lookup", "lookup-tree", "draft", "draft-tree", "hybrid", "hybrid-tree")


@lru_cache(maxsize=None)
def tokens_on(isa: str) -> dict[tuple[str, int], tuple[int, ...]]:
    """Every method's greedy tokens on a path: alone at k = 1 and 4, and two sequences batched at k = 4."""
    from draftwise.loading import QUANT_ASSEMBLY

    prompts = [tiny_tokenizer()(text)["input_ids"] for text in (TEXT, "def quick(sort): return sort(sort)")]
    out = {}
    with on_path(isa):
        for method in METHODS:
            draft = tiny_model("qwen2", 1) if method.startswith(("draft", "hybrid")) else None
            eng = Engine.from_models(tiny_quant(2.5), tiny_tokenizer(), draft_model=draft, method=method,
                                     **QUANT_ASSEMBLY)
            assert eng.speed_paths["kernel_isa"] == isa
            assert eng.speed_paths["kernel_prefetch"] == qgemm.prefetch_level()  # (what the library was built with)
            for k in (1, 4):
                out[method, k] = tuple(eng.generate(prompts[0], max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                    num_draft_tokens=k, adaptive=False).token_ids)
            cfg = GenerationConfig.from_options(max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True,
                                                method=method)
            seqs = decode_together(eng, prompts, cfg)
            out[method, -1] = tuple(t for seq, p in zip(seqs, prompts) for t in seq.context[len(p):])
    return out


@pytest.mark.skipif(not HERE, reason="no C compiler for the kernel")
@pytest.mark.parametrize("isa", HERE)
def test_every_method_gives_the_tokens_of_none_on_every_path(isa):
    got = tokens_on(isa)
    alone, batched = got["none", 1], got["none", -1]
    assert batched[:NEW_TOKENS] == alone
    for (method, k), tokens in got.items():
        assert tokens == (batched if k == -1 else alone), f"{method}, k={k} on {isa}" + (" batched" if k == -1 else "")
    if isa != FASTEST:
        assert got == tokens_on(FASTEST)


# ---- choosing a path, and refusing one ---------------------------------------------------------------------


def test_an_unknown_path_is_refused_naming_the_allowed_ones(monkeypatch):
    monkeypatch.setenv(qgemm.ISA_VARIABLE, "avx3")
    with pytest.raises(DraftwiseError, match=r"DRAFTWISE_KERNEL_ISA must be one of avx512, avxvnni, avx2, scalar"):
        qgemm.chosen_isa()


def test_a_path_the_cpu_lacks_is_refused_naming_what_it_lacks(monkeypatch):
    monkeypatch.setattr(qgemm, "_cpu_flags", lambda: "flags : sse2 avx avx2 fma f16c")  # a Haswell's
    assert qgemm.isas_here() == ("avx2", "scalar")
    monkeypatch.setenv(qgemm.ISA_VARIABLE, "avx512")
    with pytest.raises(DraftwiseError, match="avx512: this CPU lacks avx512_vnni, avx512bw, avx512f, avx512vl; it "
                                             "runs avx2, scalar"):
        qgemm.chosen_isa()
    monkeypatch.setenv(qgemm.ISA_VARIABLE, "AVX2")
    assert qgemm.chosen_isa() == "avx2"
    monkeypatch.delenv(qgemm.ISA_VARIABLE)
    assert qgemm.chosen_isa() == "avx2"  # the fastest here, unasked


def test_auto_counts_an_avx2_cpu_as_fast_and_a_plain_one_not(monkeypatch):
    monkeypatch.delenv(qgemm.ISA_VARIABLE, raising=False)
    monkeypatch.setattr(qgemm, "find_compiler", lambda: "/usr/bin/cc")
    for flags, fast in (("avx avx2 fma", True), ("avx avx2 fma avx_vnni", True), ("sse2 avx", False),
                        ("avx avx2", False)):  # (AVX2 without FMA: none ships, and the path needs both)
        monkeypatch.setattr(qgemm, "_cpu_flags", lambda flags=flags: "flags : " + flags)
        assert qgemm.fast_here() is fast, flags
    monkeypatch.setattr(qgemm, "_cpu_flags", lambda: "flags : avx avx2 fma")
    monkeypatch.setenv(qgemm.ISA_VARIABLE, "scalar")  # forced slow: auto keeps hf
    assert not qgemm.fast_here()


def test_each_paths_library_is_its_own_file():
    if not HERE:
        pytest.skip("no C compiler for the kernel")
    files = {isa: Path(qgemm.library_for(isa)._name) for isa in HERE}
    assert len(set(files.values())) == len(HERE)
    assert all(path.name.startswith(f"qgemm-{isa}-") for isa, path in files.items())
    assert all(qgemm.library_for(isa).dw_isa() == qgemm.ISA_CODES[isa] for isa in HERE)


def test_the_prefetch_goes_to_the_l2_on_intel_and_zen_5_and_to_the_l1_elsewhere(monkeypatch):
    lines = {"flags": "flags : avx avx2 fma"}
    monkeypatch.setattr(qgemm, "_cpuinfo_line", lambda key: lines.get(key, ""))
    l2 = ["-DDW_PREFETCH_L2=1"]
    for vendor, family, flag in (("GenuineIntel", "6", l2), ("AuthenticAMD", "26", l2), ("AuthenticAMD", "25", []),
                                 ("AuthenticAMD", "23", []), ("AuthenticAMD", "", []), ("", "26", [])):
        lines.update({"vendor_id": f"vendor_id\t: {vendor}", "cpu family": f"cpu family\t: {family}"})
        assert [f for f in qgemm.build_flags("avx2") if "PREFETCH" in f] == flag, (vendor, family)
    lines.update({"vendor_id": "vendor_id\t: AuthenticAMD", "cpu family": "cpu family\t: 25"})  # (Zen 4: the L1)
    for forced, flag in (("l2", l2), ("L1", []), ("auto", [])):
        monkeypatch.setenv(qgemm.PREFETCH_VARIABLE, forced)
        assert [f for f in qgemm.build_flags("avx2") if "PREFETCH" in f] == flag, forced
    monkeypatch.setenv(qgemm.PREFETCH_VARIABLE, "l3")
    with pytest.raises(DraftwiseError, match="DRAFTWISE_KERNEL_PREFETCH must be l1, l2 or auto, got 'l3'"):
        qgemm.build_flags("avx2")


def test_either_prefetch_gives_the_same_bits(tmp_path):
    """Where the weights are prefetched to is a hint to the caches: both builds of the fastest path, the same bits."""
    if FASTEST in (None, "scalar"):
        pytest.skip("no vector path of the kernel here")
    flags = [f for f in qgemm.build_flags(FASTEST) if f != qgemm.PREFETCH_L2_FLAG]
    libraries = []
    for name, extra in (("l1", []), ("l2", [qgemm.PREFETCH_L2_FLAG])):
        path = tmp_path / f"qgemm-{name}.so"
        subprocess.run([qgemm.compiler(), *flags, *extra, "-o", str(path), str(qgemm.SOURCE), "-lm"], check=True)
        libraries.append(qgemm.open_library(path, FASTEST, prefetch=name))
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(6))
    for kind in ("Q4_K", "Q6_K", "Q8_0"):
        linear, _ = layer(kind, n=48, k=1024)
        l1, l2 = (linear_on(library, linear, x) for library in libraries)
        assert torch.equal(l1, l2), kind


# ---- the control ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_order(tmp_path_factory) -> ctypes.CDLL:
    """The AVX2 path built to sum in another order (the minimum's term before the dot's; attention's lanes one by
    one): the same operations, reordered."""
    if "avx2" not in HERE:
        pytest.skip("this CPU has no AVX2 path")
    path = tmp_path_factory.mktemp("control") / "qgemm-other-order.so"
    subprocess.run([qgemm.compiler(), *qgemm.build_flags("avx2"), "-DDW_TEST_OTHER_ORDER=1", "-o", str(path),
                    str(qgemm.SOURCE), "-lm"], check=True)
    return qgemm.open_library(path, "avx2")


def test_the_control_that_sums_in_another_order_gives_other_bits(other_order, monkeypatch):
    linear, _ = layer("Q4_K", n=48, k=1024)
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(5))
    want, got = linear_on(qgemm.library_for("avx2"), linear, x), linear_on(other_order, linear, x)
    assert not torch.equal(got, want) and torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    inputs = attention_inputs(64)
    want, got = attention_on(qgemm.library_for("avx2"), *inputs), attention_on(other_order, *inputs)
    assert not torch.equal(got, want) and torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    # and on the model: what the cross-path test compares would differ
    reference = logits_on(FASTEST)
    monkeypatch.setattr(qgemm, "library_for", lambda isa: other_order)
    with on_path("avx2"):
        reordered = model_logits()
    assert not any(torch.equal(reordered[name], reference[name]) for name in reference)
    assert all(np.allclose(reordered[name], reference[name], atol=1e-3) for name in reference)
