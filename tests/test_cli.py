"""The command line: output contracts (text, JSON, stats line, colors), errors and exit codes, the models commands.

No network and no real model: `cli._load_engine` is replaced by tiny random models in memory, and the store
runs against an empty DRAFTWISE_HOME with subprocess (pip) disabled.
"""
from __future__ import annotations

import functools
import io
import json
import re
import subprocess
import sys

import pytest
from conftest import tiny_model, tiny_tokenizer

import draftwise
from draftwise import cli
from draftwise.methods import DRAFT_MODEL, methods_needing
from draftwise.engine import Engine
from draftwise.metrics import Stats
from draftwise.errors import DraftwiseError
from draftwise.models import KNOWN_MODELS, ModelStatus

PROMPT = "The quick brown fox jumps over the lazy dog. The dog"
N = 24  # new tokens per run: enough for several rounds, fast on a tiny model
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@functools.cache
def _model(which: str):
    # "same" is the target itself (every draft token accepted); "other" is unrelated (few accepted).
    return tiny_model("llama", seed=1) if which == "other" else tiny_model("llama", seed=0)


def _engine(draft: str | None = None, method: str | None = None, lookup_max_ngram: int = 3) -> Engine:
    draft_model = _model(draft) if draft is not None and method in (None, *methods_needing(DRAFT_MODEL)) else None
    return Engine.from_models(_model("target"), tiny_tokenizer(), draft_model=draft_model, method=method,
                              lookup_max_ngram=lookup_max_ngram)


@functools.cache
def _direct(draft: str | None = None, method: str | None = None, **options):
    """What the engine gives when called directly (the reference for the CLI's output), computed once."""
    return _engine(draft, method).generate(PROMPT, max_new_tokens=N, **options)


@pytest.fixture
def loads(monkeypatch):
    """Replace model loading with tiny models; `--draft same|other` picks the draft. Records each load."""
    calls = []

    def fake(args):
        calls.append(args)
        return _engine(args.draft, args.method, args.lookup_ngram)

    monkeypatch.setattr(cli, "_load_engine", fake)
    return calls


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty model store, and no way to reach the network (pulls run pip through subprocess)."""
    home = tmp_path / "home"
    monkeypatch.setenv("DRAFTWISE_HOME", str(home))
    monkeypatch.chdir(tmp_path)

    def no_network(*args, **kwargs):
        raise AssertionError(f"a test tried to run a subprocess: {args}")

    monkeypatch.setattr(subprocess, "run", no_network)
    return home


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def gen(*extra: str) -> list[str]:
    return ["generate", "--target", "tiny", "--prompt", PROMPT, "--max-new-tokens", str(N), *extra]


def run_json(capsys, *extra: str) -> dict:
    code, out, err = run(capsys, *gen(*extra, "--json"))
    assert code == 0, err
    assert out.endswith("\n") and out.count("\n") == 1, "--json prints exactly one line"
    return json.loads(out)


# ---- generate: output contracts -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, method, draft",
    [((), "lookup", None), (("--draft", "other"), "draft", "other"), (("--method", "none"), "none", None),
     (("--draft", "other", "--method", "hybrid"), "hybrid", "other")],  # (every method with a draft names it)
)
def test_generate_json_shape_and_text(capsys, loads, extra, method, draft):
    got = run_json(capsys, *extra)
    assert set(got) == {"text", "token_ids", "finish_reason", "stats", "method", "target", "draft"}
    assert (got["method"], got["target"], got["draft"]) == (method, "tiny", draft)
    assert set(got["stats"]) == set(Stats(method="x", num_draft_tokens=1).to_dict())
    assert {"proposed", "accepted", "acceptance_rate", "mean_accepted_length", "per_position_acceptance",
            "target_forwards", "draft_s", "verify_s", "overhead_s", "tokens_per_s", "cost_ratio",
            "predicted_speedup"} <= set(got["stats"])
    assert all(type(t) is int for t in got["token_ids"])
    want = _direct(draft, method)
    assert got["text"] == want.text
    assert got["token_ids"] == want.token_ids
    assert got["finish_reason"] == want.finish_reason
    assert got["stats"]["method"] == method
    assert got["stats"]["new_tokens"] == len(got["token_ids"]) == N


def test_json_prints_nothing_else(capsys, loads):
    code, out, err = run(capsys, *gen("--draft", "other", "--json"))
    assert code == 0
    assert err == "", "--json: no loading messages and no stats line"
    json.loads(out)


def test_plain_output_is_exactly_the_text_without_ansi(capsys, loads):
    code, out, err = run(capsys, *gen("--draft", "same"))  # all draft tokens: would be colored on a terminal
    assert code == 0
    want = _direct("same")
    assert out == want.text
    assert "\x1b" not in out and "\x1b" not in err
    assert "loading target tiny, draft same" in err


def test_stats_line_on_stderr_matches_the_run(capsys, loads):
    code, out, err = run(capsys, *gen("--draft", "other", "-k", "3"))
    assert code == 0
    line = err.strip().splitlines()[-1]
    m = re.fullmatch(
        r"\[draft k=3 float32\] (\d+) tokens, ([\d.]+) tok/s, acceptance ([\d.]+)%, "
        r"mean accepted length ([\d.]+), (\d+) target passes",
        line,
    )
    assert m, line
    stats = _direct("other", num_draft_tokens=3).stats
    assert int(m[1]) == stats.new_tokens == N
    assert float(m[3]) == pytest.approx(100 * stats.acceptance_rate, abs=0.05)
    assert float(m[4]) == pytest.approx(stats.mean_accepted_length, abs=0.005)
    assert int(m[5]) == stats.target_forwards
    assert line not in out


def test_stats_line_for_the_baseline(capsys, loads):
    code, _, err = run(capsys, *gen("--method", "none"))
    assert code == 0
    assert re.fullmatch(rf"\[none float32\] {N} tokens, [\d.]+ tok/s, {N} target passes", err.strip().splitlines()[-1])


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("flags, env, colored", [((), None, True), (("--no-color",), None, False),
                                                 ((), "1", False)])
def test_draft_tokens_colored_only_on_a_terminal(capsys, loads, monkeypatch, flags, env, colored):
    if env is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", env)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert cli.main(gen("--draft", "same", *flags)) == 0
    out = terminal.getvalue()
    want = _direct("same").text
    assert ("\x1b[32m" in out) is colored
    assert ANSI.sub("", out).rstrip("\n") == want.rstrip("\n")
    assert out.endswith("\n"), "a terminal gets its prompt back on a fresh line"


class _Recorder(io.StringIO):
    """Remembers what had been written at each flush."""

    def __init__(self):
        super().__init__()
        self.flushed: list[str] = []

    def flush(self):
        self.flushed.append(self.getvalue())


def test_text_is_flushed_piece_by_piece(capsys, loads, monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    assert cli.main(gen("--method", "none")) == 0
    text = _direct(method="none").text
    assert recorder.getvalue() == text
    pieces = [event.text for event in _engine(method="none").stream(PROMPT, max_new_tokens=N) if event.text]
    assert len(pieces) > 2
    assert len({s for s in recorder.flushed if s}) == len(pieces), "one flush per piece, not one at the end"
    assert all(text.startswith(s) for s in recorder.flushed)


def test_quiet_prints_only_the_text(capsys, loads):
    code, out, err = run(capsys, *gen("--quiet"))
    assert code == 0
    assert err == ""
    assert out == _direct().text


def _check_speculated(stats: dict, method: str) -> None:
    """The method named actually ran and proposed tokens; otherwise identity with `none` would prove nothing."""
    assert stats["method"] == method
    assert stats["proposed"] > 0  # the first round always drafts the full k
    assert 0 <= stats["accepted"] <= stats["proposed"]
    # Each target pass emits the kept draft tokens plus one of its own.
    assert stats["accepted"] + stats["target_forwards"] == N


@pytest.mark.parametrize("k", ["1", "4"])
def test_greedy_token_ids_identical_for_every_method(capsys, loads, k):
    baseline = run_json(capsys, "--method", "none", "-k", k)
    assert len(baseline["token_ids"]) == N
    assert baseline["stats"]["method"] == "none" and baseline["stats"]["proposed"] == 0
    assert baseline["stats"]["target_forwards"] == N

    other = run_json(capsys, "--draft", "other", "-k", k)
    assert other["token_ids"] == baseline["token_ids"]
    _check_speculated(other["stats"], "draft")

    same = run_json(capsys, "--draft", "same", "-k", k)
    assert same["token_ids"] == baseline["token_ids"]
    _check_speculated(same["stats"], "draft")
    assert same["stats"]["accepted"] > 0, "the target's twin as draft must get tokens kept"

    lookup = run_json(capsys, "--method", "lookup", "-k", k)
    assert lookup["token_ids"] == baseline["token_ids"]
    _check_speculated(lookup["stats"], "lookup")


def test_options_reach_the_engine(capsys, loads):
    """--stop (repeatable), --chat, sampling with --seed and --ignore-eos are passed to stream()."""
    plain = _direct().text
    cut = plain[len(plain) // 2 :][:3]
    assert cut.strip(), "need a visible stop string from the middle of the text"
    got = run_json(capsys, "--stop", "never-in-text", "--stop", cut)
    assert got["finish_reason"] == "stop"
    assert got["text"] == plain[: plain.index(cut)]

    chat = run_json(capsys, "--chat")
    assert chat["token_ids"] == _direct(chat=True).token_ids

    sampled = run_json(capsys, "--draft", "other", "--temperature", "1.0", "--top-k", "50", "--top-p", "0.9",
                       "--seed", "7", "--ignore-eos")
    want = _direct("other", temperature=1.0, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    assert sampled["token_ids"] == want.token_ids
    reseeded = run_json(capsys, "--draft", "other", "--temperature", "1.0", "--top-k", "50", "--top-p", "0.9",
                        "--seed", "8", "--ignore-eos")
    assert sampled["token_ids"] != reseeded["token_ids"], "the seed must matter"


def test_prompt_from_stdin_and_from_a_file(capsys, loads, monkeypatch, tmp_path):
    want = _direct().token_ids
    # Standard input is read as bytes and decoded as UTF-8 whatever the locale's encoding says.
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(PROMPT.encode()), encoding="ascii"))
    args = gen("--json")
    args[args.index("--prompt") + 1] = "-"
    code, out, _ = run(capsys, *args)
    assert code == 0 and json.loads(out)["token_ids"] == want
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ab\xff"), encoding="utf-8"))
    code, out, err = run(capsys, *args)
    assert code != 0 and not out and "standard input is not UTF-8 text (invalid start byte at byte 2)" in err

    path = tmp_path / "prompt.txt"
    path.write_text(PROMPT, encoding="utf-8")
    code, out, _ = run(capsys, "generate", "--target", "tiny", "--prompt-file", str(path),
                       "--max-new-tokens", str(N), "--json")
    assert code == 0 and json.loads(out)["token_ids"] == want


def test_load_engine_passes_the_options_to_from_pretrained(capsys, monkeypatch):
    seen = {}

    def from_pretrained(**kwargs):
        seen.update(kwargs)
        return _engine("other", "draft")

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(from_pretrained))
    code, _, _ = run(capsys, *gen("--draft", "tiny-draft", "--method", "draft", "--dtype", "bfloat16",
                                  "--device", "cuda:1", "--lookup-ngram", "5", "--quiet"))
    assert code == 0
    assert seen == {"target": "tiny", "draft": "tiny-draft", "method": "draft", "dtype": "bfloat16",
                    "device": "cuda:1", "progress": False, "lookup_max_ngram": 5, "backend": "auto"}
    code, _, _ = run(capsys, *gen("--backend", "llamacpp", "--method", "none", "--quiet"))
    assert code == 0 and seen["backend"] == "llamacpp"
    seen.clear()
    code, _, _ = run(capsys, *gen("--backend", "hf", "--method", "none", "--quiet"))
    assert code == 0 and "backend" not in seen  # Python's own default


def test_ignored_draft_is_mentioned(capsys, loads):
    code, _, err = run(capsys, *gen("--draft", "other", "--method", "none"))
    assert code == 0
    assert "--draft is ignored with --method none" in err
    code, _, err = run(capsys, *gen("--head", "some-head", "--method", "none"))
    assert code == 0 and "--head is ignored with --method none (it serves head, hybrid-head)" in err


# ---- generate: errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (("-k", "0"), "num_draft_tokens (k) must be >= 1, got 0"),
        (("--num-draft-tokens", "-2"), "num_draft_tokens (k) must be >= 1, got -2"),
        (("--temperature", "-0.5"), "temperature must be a finite number >= 0"),
        (("--top-p", "0"), "top_p must be in (0, 1], got 0.0"),
        (("--top-p", "1.5"), "top_p must be in (0, 1], got 1.5"),
        (("--max-new-tokens", "0"), "max_new_tokens must be >= 1"),
        (("--stop", ""), "stop strings must be non-empty"),
        (("--lookup-ngram", "0"), "--lookup-ngram must be >= 1, got 0"),
        (("--prompt", ""), "the prompt is empty"),
    ],
)
def test_bad_values_exit_1_before_loading(capsys, loads, extra, message):
    code, out, err = run(capsys, *gen(*extra))
    assert code == 1
    assert out == ""
    assert err.startswith("draftwise: error: ") and message in err
    assert "Traceback" not in err
    assert loads == [], "settings are checked before a model loads"


def test_limits_checked_by_the_engine_exit_1(capsys, loads):
    code, out, err = run(capsys, *gen("--max-new-tokens", "600", "--quiet"))  # the tiny model's context is 512
    assert code == 1 and out == ""
    assert err.startswith("draftwise: error: ") and "exceeds the model context of 512 tokens" in err
    code, _, err = run(capsys, *gen("-k", "65"))
    assert code == 1 and "num_draft_tokens (k) must be between 1 and 64, got 65" in err


@pytest.mark.parametrize("argv", [
    gen("--method", "magic"),  # not one of the choices
    gen("--prompt-file", "x.txt"),  # two prompts
    ["generate", "--target", "tiny"],  # no prompt
    gen("-k", "four"),
    ["serve", "--port", "eighty"],  # not a number
    [],
])
def test_usage_errors_exit_2(capsys, loads, argv):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert "usage:" in capsys.readouterr().err
    assert loads == []


def test_missing_prompt_file_names_the_path(capsys, loads, tmp_path):
    missing = tmp_path / "nope" / "prompt.txt"
    code, out, err = run(capsys, "generate", "--target", "tiny", "--prompt-file", str(missing))
    assert code == 1 and out == ""
    assert err == f"draftwise: error: prompt file not found: {missing}\n"
    assert loads == []


def test_unknown_model_lists_the_known_names(capsys, store):
    code, out, err = run(capsys, "generate", "--target", "no-such-model", "--prompt", "hi", "--quiet")
    assert code == 1 and out == ""
    assert err.startswith("draftwise: error: ") and "'no-such-model'" in err
    assert all(name in err for name in KNOWN_MODELS)
    assert "Traceback" not in err
    assert not (store / "models").exists()


def test_draft_method_without_a_draft_is_an_error(capsys, store):
    code, _, err = run(capsys, "generate", "--target", "no-such-model", "--method", "draft", "--prompt", "hi")
    assert code == 1
    assert "method 'draft' needs a draft model" in err


def test_interrupt_exits_130_quietly(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_load_engine", interrupted)
    code, out, err = run(capsys, *gen("--quiet"))
    assert code == 130
    assert out == "" and err == ""


# ---- models ---------------------------------------------------------------------------------------------


def test_models_list_json_on_an_empty_store(capsys, store):
    code, out, err = run(capsys, "models", "list", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [row["name"] for row in rows] == list(KNOWN_MODELS)
    for row in rows:
        assert row == {"name": row["name"], "description": KNOWN_MODELS[row["name"]].description,
                       "pulled": False, "size_on_disk": 0, "float_copy": 0, "packed_bytes": 0, "path": None,
                       "terms": KNOWN_MODELS[row["name"]].terms}
        assert row["terms"]  # every packaged model says what its weights come under


def test_models_list_table(capsys, monkeypatch, tmp_path):
    statuses = [
        ModelStatus("big-model", "a pulled one", True, 3 * 1024**3 // 2, tmp_path / "big-model", "Apache-2.0",
                    float_copy=1024**3),
        ModelStatus("gguf-model", "the GGUF alone", True, 1024**2, tmp_path / "gguf-model", "MIT",
                    packed_bytes=3 * 1024**2),
        ModelStatus("small-model", "not pulled", False, 0, None, "Gemma Terms of Use"),
    ]
    monkeypatch.setattr("draftwise.models.list_models", lambda: statuses)
    code, out, _ = run(capsys, "models", "list")
    assert code == 0
    header, big, gguf, small = out.splitlines()
    assert header.split() == ["NAME", "PULLED", "SIZE", "FLOAT-COPY", "PACKED", "TERMS", "DESCRIPTION", "PATH"]
    assert big.split()[:8] == ["big-model", "yes", "1.5", "GiB", "1.0", "GiB", "-", "Apache-2.0"]
    assert big.endswith(str(tmp_path / "big-model"))
    assert gguf.split()[:8] == ["gguf-model", "yes", "1.0", "MiB", "-", "3.0", "MiB", "MIT"]
    assert small.split()[:7] == ["small-model", "no", "-", "-", "-", "Gemma", "Terms"] and small.endswith("-")
    assert big.index("yes") == small.index("no"), "columns line up"


def test_human_size():
    assert [cli.human_size(n) for n in (0, 1023, 1024, 5 * 1024**2 + 1, 1117320768, 5 * 1024**4)] == [
        "0 B", "1023 B", "1.0 KiB", "5.0 MiB", "1.0 GiB", "5120.0 GiB"]


def test_models_path(capsys, store):
    name = next(iter(KNOWN_MODELS))
    code, out, err = run(capsys, "models", "path", name)
    assert code == 1 and out == ""
    assert err.startswith("draftwise: error: ") and "not pulled" in err and f"draftwise models pull {name}" in err

    code, _, err = run(capsys, "models", "path", "no-such-model")
    assert code == 1 and all(known in err for known in KNOWN_MODELS)

    from draftwise.models.store import MANIFEST  # what marks a folder pulled (of this pin)

    folder = store / "models" / name
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text(json.dumps({"sha256": "0" * 64}))  # another pin of the name: not this one
    assert run(capsys, "models", "path", name)[0] == 1
    (folder / MANIFEST).write_text(json.dumps({"sha256": KNOWN_MODELS[name].sha256}))
    code, out, _ = run(capsys, "models", "path", name)
    assert code == 0 and out == f"{folder}\n"
    code, out, _ = run(capsys, "models", "path", name, "--json")
    assert code == 0 and json.loads(out) == {"name": name, "path": str(folder)}
    code, out, _ = run(capsys, "models", "list", "--json")
    assert [row["pulled"] for row in json.loads(out)] == [n == name for n in KNOWN_MODELS]


def test_models_rm_removes_the_folder_and_its_packing_cache(capsys, store, tmp_path):
    import numpy as np

    from draftwise.backends.gguf_cache import PackCache
    from draftwise.backends.gguf_weights import pack, quantize_draft
    from draftwise.models.store import MANIFEST

    name = next(iter(KNOWN_MODELS))
    code, out, err = run(capsys, "models", "rm", name)
    assert code == 1 and out == "" and "not in the store" in err
    folder = store / "models" / name
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text(json.dumps({"sha256": KNOWN_MODELS[name].sha256}))
    gguf, other = folder / "m.gguf", tmp_path / "other.gguf"
    for file in (gguf, other):
        file.write_bytes(b"GGUF")
        PackCache.of(file).save({"w": (pack(quantize_draft(np.ones((16, 64), dtype=np.float32))), "file")})
    ours, theirs = PackCache.of(gguf).path, PackCache.of(other).path
    cached, size = ours.stat().st_size, sum(p.stat().st_size for p in folder.iterdir())
    code, out, _ = run(capsys, "models", "list", "--json")
    assert [row["packed_bytes"] for row in json.loads(out) if row["name"] == name] == [cached]
    code, out, _ = run(capsys, "models", "rm", name, "--json")
    assert code == 0 and json.loads(out) == {"name": name, "removed_bytes": size, "packed_bytes": cached}
    assert not folder.exists() and not ours.exists() and theirs.exists()  # another file's entry is kept


def test_models_pull(capsys, monkeypatch, tmp_path):
    calls = []

    def pull(name, *, progress=True, force=False):
        calls.append((name, progress, force))
        return tmp_path / name

    monkeypatch.setattr("draftwise.models.pull", pull)
    code, out, _ = run(capsys, "models", "pull", "some-model")
    assert code == 0 and out == f"{tmp_path / 'some-model'}\n"
    code, out, _ = run(capsys, "models", "pull", "some-model", "--force", "--quiet")
    assert code == 0
    assert calls == [("some-model", True, False), ("some-model", False, True)]


def test_models_pull_error_exits_1(capsys, store):
    code, out, err = run(capsys, "models", "pull", "no-such-model")
    assert code == 1 and out == ""
    assert err.startswith("draftwise: error: unknown model 'no-such-model'")


# ---- help and version ------------------------------------------------------------------------------------


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"draftwise {draftwise.__version__}\n"


@pytest.mark.parametrize("argv, words", [
    ([], ["generate", "models", "bench", "serve", "loadgen"]),
    (["serve"], ["--target", "--draft", "--host", "--port", "--api-key", "DRAFTWISE_API_KEY", "--max-batch",
                 "--max-waiting", "--prefill-chunk", "--drain-timeout", "curl"]),
    (["loadgen"], ["--url", "--concurrency", "--speculation", "--requests", "--max-tokens", "--out", "--json"]),
    (["bench"], ["--methods", "hf-assisted", "--categories", "--per-category", "--limit", "--prompts", "--repeats",
                 "--out", "--dtype", "--json", "(default: 128)", "(default: 3)", "(default: bench-results)"]),
    (["generate"], ["--target", "--draft", "--method", "--prompt-file", "--stop", "--json", "--no-color", "--fixed-k",
                    "(default: 128)", "(default: 4)", "(default: auto)", "(default: 0.0)", "(default: 1.0)"]),
    (["models"], ["list", "pull", "path"]),
    (["models", "list"], ["--json"]),
    (["models", "pull"], ["--force", "NAME"]),
    (["models", "path"], ["NAME"]),
])
def test_help(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    assert all(word in out for word in words), [w for w in words if w not in out]


def test_python_dash_m_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "draftwise", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"draftwise {draftwise.__version__}"


@pytest.mark.parametrize("command", [["generate", "--target", "qwen2.5-coder-1.5b-instruct", "--prompt", "hi", "-q"],
                                     ["bench", "--methods", "none", "-q"], ["serve"], ["train-head", "-q"]])
@pytest.mark.parametrize("device,message", [
    ("tpu", "device must be cpu, cuda or cuda:N, got 'tpu'"),
    ("cuda", "device 'cuda': no CUDA GPU is usable here"),
])
def test_a_device_the_machine_lacks_is_refused_before_any_pull(capsys, store, monkeypatch, command, device, message):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code, out, err = run(capsys, *command, "--device", device)
    assert code == 1 and message in err and "Traceback" not in err
    assert not (store / "models").exists()


def test_check_device_names_the_gpus_there_are(monkeypatch):
    from draftwise.hardware import check_device

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    assert check_device("cuda:1") == "cuda:1" and check_device("cpu") == "cpu"
    with pytest.raises(DraftwiseError, match=r"device 'cuda:2': this machine has 2 CUDA GPU\(s\), cuda:0 to cuda:1"):
        check_device("cuda:2")


@pytest.mark.parametrize("flag, value, message", [
    ("--max-batch", "0", "--max-batch must be a number >= 1, got 0"),
    ("--prefill-chunk", "0", "--prefill-chunk must be a number >= 1, got 0"),
    ("--max-waiting", "-1", "--max-waiting must be a number >= 0"),
    ("--prompt-cache-mb", "nan", "--prompt-cache-mb must be a number >= 0"),
    ("--drain-timeout", "-5", "--drain-timeout must be a number >= 0, got -5.0"),
    ("--draft-timeout-ms", "0", "--draft-timeout-ms must be a number > 0"),
    ("--api-key", "", "--api-key (or $DRAFTWISE_API_KEY) is empty"),
    ("--proposal-log-days", "0", "--proposal-log-days must be a number of days > 0"),
    ("--proposal-log-days", "7", "--proposal-log-days limits the proposal log: give --proposal-log PATH too"),
])
def test_serve_refuses_bad_limits_before_loading_naming_the_flag(capsys, store, monkeypatch, flag, value, message):
    def no_load(*args, **kwargs):
        raise AssertionError("a model loaded before the options were checked")

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(no_load))
    code, out, err = run(capsys, "serve", "--port", "1", flag, value)
    assert code == 1 and message in err and "Traceback" not in err


def test_the_loading_line_names_the_dtype_auto_takes_on_the_device_asked_for(capsys, loads, monkeypatch):
    monkeypatch.setattr("draftwise.hardware.resolve_dtype", lambda name, device="cpu": f"native on {device}")
    code, _, err = run(capsys, *gen("--device", "cuda:1"))
    assert code == 0 and "(auto: native on cuda:1)" in err


# ---- generate: structured output ------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"], "additionalProperties": False}


def test_generate_under_a_json_schema_gives_json_valid_under_it(capsys, loads, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    got = run_json(capsys, "--draft", "other", "--json-schema", str(path), "--max-new-tokens", "60")
    assert got["finish_reason"] == "eos" and json.loads(got["text"])["n"] in (1, 2, 3)
    plain = run_json(capsys, "--draft", "other", "--method", "none", "--json-schema", str(path),
                     "--max-new-tokens", "60")
    assert plain["token_ids"] == got["token_ids"]  # the target alone under the schema, token for token
    lark = tmp_path / "g.lark"
    lark.write_text('start: "yes" | "no"')
    assert run_json(capsys, "--lark", str(lark))["text"] in ("yes", "no")


@pytest.mark.parametrize("content, message", [
    ("{not json", "--json-schema .*: not JSON"), ("[1, 2]", "a JSON schema is an object, got list"),
    ('{"type": "frobnicate"}', "frobnicate")])
def test_a_bad_schema_file_is_an_error_that_says_why(capsys, loads, tmp_path, content, message):
    path = tmp_path / "schema.json"
    path.write_text(content)
    code, out, err = run(capsys, *gen("--json-schema", str(path)))
    assert code != 0 and out == "" and re.search(message, err)
    code, _, err = run(capsys, *gen("--json-schema", str(tmp_path / "missing.json")))
    assert code != 0 and "--json-schema file not found" in err
