"""llama.cpp as a bench peer: the request the bench sends, the timings it reads, starting and stopping the server.

A fake llama-server (a small Python program on 127.0.0.1, answering /health, /props and /completion as llama-server
does) stands in for the real one, so that everything but llama.cpp's own numbers is checked without a build. The
real_model test runs the built server on SmolLM2's GGUF, and is skipped, saying why, where there is none.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from draftwise.bench.llamacpp_server import (LlamaServer, LlamaServerError, ServerSpec, built_binary_path,
                                             completion_request, find_gguf, parse_completion, server_binary)
from draftwise.bench.runners import GgufFiles, LlamaCppPeers

FAKE_SERVER = r'''
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
log = os.environ["FAKE_LLAMA_LOG"]
mode = os.environ.get("FAKE_LLAMA_MODE", "ok")
with open(log, "a") as f:
    f.write(json.dumps({"argv": args}) + "\n")
print("main: loading model", flush=True)
if mode == "exit":
    print("error: failed to load model", flush=True)
    sys.exit(3)
print("system_info: n_threads = 2 / 2 | CPU : AVX512 = 1 | AVX512_BF16 = 1 |", flush=True)
started = time.monotonic()
speculating = "--spec-type" in args


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            loading = mode == "never" or time.monotonic() - started < 0.3
            self.answer(503 if loading else 200, {"status": "loading model" if loading else "ok"})
        elif self.path == "/props":
            self.answer(200, {"build_info": "b9999-fake", "model_ftype": "Q4_K - Medium"})
        else:
            self.answer(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(log, "a") as f:
            f.write(json.dumps({"request": body}) + "\n")
        n = body["n_predict"]
        tokens = [(body["prompt"][-1] + i + 1) % 1000 for i in range(n)]
        timings = {"prompt_n": len(body["prompt"]), "prompt_ms": 12.5, "predicted_n": n,
                   "predicted_ms": 250.0, "predicted_per_second": 4.0 * (n - 1) if n > 1 else 0.0}
        if speculating:
            timings.update(draft_n=10, draft_n_accepted=6)
        self.answer(200, {"content": "x" * n, "tokens": tokens, "timings": timings})


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake llama-server binary, in a bin/ folder as a build lays it out; .entries(key) reads what it was started
    with and sent."""
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    binary.chmod(0o755)
    log = tmp_path / "fake.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))

    class Fake:
        path = binary

        @staticmethod
        def entries(key):
            lines = log.read_text().splitlines() if log.exists() else []
            return [json.loads(line)[key] for line in lines if key in json.loads(line)]

    return Fake


def _model(tmp_path) -> Path:
    model = tmp_path / "target.Q4_K_M.gguf"
    model.write_bytes(b"GGUF")
    return model


def test_request_sends_token_ids_greedy_with_eos_ignored():
    body = completion_request([1, 2, 3], 16)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 16 and body["ignore_eos"] is True
    assert body["temperature"] == 0.0 and body["top_k"] == 1 and body["samplers"] == ["top_k"]
    assert body["return_tokens"] is True and body["cache_prompt"] is False and body["stream"] is False


def test_a_schema_goes_to_llama_cpps_own_grammar_and_ends_at_eos():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = completion_request([1, 2, 3], 16, schema)
    assert body["json_schema"] == schema and body["ignore_eos"] is False and body["n_predict"] == 16
    assert "json_schema" not in completion_request([1, 2, 3], 16)


def test_timings_parsed_with_and_without_drafts():
    plain = parse_completion({"tokens": [5, 6, 7], "timings": {"predicted_n": 3, "predicted_ms": 40.0,
                                                                "predicted_per_second": 50.0, "prompt_ms": 9.0}})
    assert plain.token_ids == [5, 6, 7] and plain.tokens_per_s == 50.0 and plain.prompt_ms == 9.0
    assert plain.draft_n is None and plain.draft_accepted is None
    drafted = parse_completion({"tokens": [1], "timings": {"predicted_n": 1, "predicted_per_second": 0.0,
                                                          "draft_n": 4, "draft_n_accepted": 3}})
    assert drafted.tokens_per_s is None  # one token: nothing timed after the prompt's
    assert (drafted.draft_n, drafted.draft_accepted) == (4, 3)
    with pytest.raises(LlamaServerError, match="without tokens or timings"):
        parse_completion({"content": "hello"})


def test_server_round_trip_against_a_fake_llama_server(tmp_path, fake):
    spec = ServerSpec(_model(tmp_path), threads=2)
    with LlamaServer(spec, binary=fake.path, startup_timeout_s=20) as server:
        done = server.complete([10, 20, 30], 5)
        props = server.props()
        info = server.system_info()
        process = server._process
    assert process.poll() is not None  # stopped on leaving the block
    assert fake.entries("request") == [completion_request([10, 20, 30], 5)]
    argv = fake.entries("argv")[0]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("-t") + 1] == "2"
    assert argv[argv.index("-m") + 1] == str(spec.model) and "-md" not in argv and "--spec-type" not in argv
    assert done.token_ids == [31, 32, 33, 34, 35] and done.tokens_per_s == 16.0 and done.predicted_n == 5
    assert props["build_info"] == "b9999-fake"
    assert info.startswith("n_threads = 2 / 2 | CPU : AVX512 = 1")


def test_peers_make_run_records_and_name_their_engine(tmp_path, fake):
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    peers = LlamaCppPeers(GgufFiles(_model(tmp_path), draft), threads=2, binary=fake.path)
    try:
        plain, plain_ids = peers.run("lcpp-plain", [7], 9)
        drafted, _ = peers.run("lcpp-draft", [7], 9)
        ngram, _ = peers.run("lcpp-ngram", [7], 9)
        engine = peers.engine("lcpp-draft")
    finally:
        peers.close()
    assert plain_ids == list(range(8, 17))
    # llama.cpp's rate (tokens after the first over their seconds) for all nine tokens, as the hf peers are timed
    assert plain["tokens_per_s"] == 32.0 and plain["decode_s"] == pytest.approx(9 / 32.0)
    assert plain["target_forwards"] == 9 and plain["proposed"] is None and plain["accepted"] is None
    assert drafted["proposed"] == 10 and drafted["accepted"] == 6 and drafted["target_forwards"] == 3
    assert ngram["proposed"] == 10
    argvs = fake.entries("argv")
    draft_argv = next(a for a in argvs if "-md" in a)
    assert draft_argv[draft_argv.index("-md") + 1] == str(draft)
    assert draft_argv[draft_argv.index("--spec-type") + 1] == "draft-simple"
    assert any(a[a.index("--spec-type") + 1] == "ngram-mod" for a in argvs if "--spec-type" in a and "-md" not in a)
    assert "b9999-fake" in engine and "draft.gguf" in engine and "Q4_K - Medium" in engine
    assert engine.endswith("; 2 threads, CPU: AVX512, AVX512_BF16") and "|" not in engine  # a table cell


def test_a_server_that_never_gets_ready_times_out_and_is_stopped(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_MODE", "never")
    server = LlamaServer(ServerSpec(_model(tmp_path)), binary=fake.path, startup_timeout_s=1.0)
    with pytest.raises(LlamaServerError, match=r"did not become ready within 1 s[\s\S]*system_info"):
        server.start()
    assert server._process is None  # killed, not left behind


def test_a_server_that_exits_while_starting_says_why(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_MODE", "exit")
    server = LlamaServer(ServerSpec(_model(tmp_path)), binary=fake.path, startup_timeout_s=20)
    with pytest.raises(LlamaServerError, match=r"exited with code 3[\s\S]*failed to load model"):
        server.start()


def test_no_built_server_says_how_to_build_one(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    monkeypatch.delenv("DRAFTWISE_LLAMA_SERVER", raising=False)
    with pytest.raises(LlamaServerError, match=r"no llama-server built at .*make llama-server"):
        server_binary()
    assert built_binary_path().is_relative_to(tmp_path)
    monkeypatch.setenv("DRAFTWISE_LLAMA_SERVER", str(tmp_path / "nowhere"))
    with pytest.raises(LlamaServerError, match="DRAFTWISE_LLAMA_SERVER names .*nowhere"):
        server_binary()


def test_bench_with_lcpp_fails_before_loading_without_a_build(tmp_path, monkeypatch):
    from draftwise.bench.run import BenchConfig

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    monkeypatch.delenv("DRAFTWISE_LLAMA_SERVER", raising=False)
    with pytest.raises(LlamaServerError, match="make llama-server"):
        BenchConfig(target="tiny", methods=("none", "lcpp-plain")).check()


def test_gguf_found_given_kept_or_asked_for(tmp_path, monkeypatch):
    from draftwise.models.registry import KNOWN_MODELS

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    name = "smollm2-135m-instruct"
    with pytest.raises(LlamaServerError, match=f"draftwise models pull {name} --force"):
        find_gguf(name)
    kept = tmp_path / "models" / name / KNOWN_MODELS[name].gguf_file
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"GGUF")
    assert find_gguf(name) == kept
    given = _model(tmp_path)
    assert find_gguf(name, str(given)) == given and find_gguf(str(given)) == given
    with pytest.raises(LlamaServerError, match="--draft-gguf .*no such file"):
        find_gguf(name, str(tmp_path / "missing.gguf"), "--draft-gguf")
    folder = tmp_path / "hf-folder"
    folder.mkdir()
    with pytest.raises(LlamaServerError, match="give --target-gguf"):
        find_gguf(str(folder))  # a Hugging Face folder without a .gguf


@pytest.mark.real_model
def test_real_llama_server_runs_smollm2_greedy():
    """The built llama-server on SmolLM2's GGUF: 8 greedy tokens, the same on a second run, timed."""
    name = "smollm2-135m-instruct"
    try:
        binary = server_binary()
    except LlamaServerError as error:
        pytest.skip(f"llama-server is not built: {error}")
    try:
        model = find_gguf(name)
    except LlamaServerError as error:
        pytest.skip(str(error))
    peers = LlamaCppPeers(GgufFiles(model), threads=min(2, os.cpu_count() or 1), binary=binary)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]  # SmolLM2 token ids: a short chat prompt
    try:
        first, ids = peers.run("lcpp-plain", prompt, 8)
        _, again = peers.run("lcpp-plain", prompt, 8)
        engine = peers.engine("lcpp-plain")
    finally:
        peers.close()
    assert len(ids) == 8 and ids == again
    assert first["tokens_per_s"] > 0 and first["decode_s"] > 0
    assert "llama.cpp" in engine and model.name in engine


def test_bench_interleaves_lcpp_with_ours_and_reports_its_engine(tmp_path, fake, monkeypatch):
    from conftest import tiny_model, tiny_tokenizer

    from draftwise.bench.run import BenchConfig, run_bench

    monkeypatch.setenv("DRAFTWISE_LLAMA_SERVER", str(fake.path))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "code", "turns": ["def f(x):"]}) + "\n")
    cfg = BenchConfig(target="tiny", methods=("none", "lcpp-plain"), prompts_file=str(prompts), per_category=None,
                      max_new_tokens=6, repeats=2, out=str(tmp_path / "out"), progress=False, roofline=False,
                      target_gguf=str(_model(tmp_path)))
    results = run_bench(cfg, models=(tiny_model("llama"), tiny_tokenizer(), None))
    order = [(r["method"], r["repeat"]) for r in results["runs"]]
    # interleaved in one process, the second repeat the first backwards
    assert order == [("none", 0), ("lcpp-plain", 0), ("lcpp-plain", 1), ("none", 1)]
    lcpp = [r for r in results["runs"] if r["method"] == "lcpp-plain"]
    assert all(r["new_tokens"] == 6 and r["tokens_per_s"] == 20.0 and r["identical"] is False for r in lcpp)
    assert "b9999-fake" in results["engines"][cfg.dtype]["lcpp-plain"]
    assert results["engines"][cfg.dtype]["none"].startswith("draftwise on PyTorch")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Engines" in report and "b9999-fake" in report
    assert len(fake.entries("request")) == 3  # the warm-up and two repeats, on one server started once
    assert len(fake.entries("argv")) == 1
