"""One generation of one prompt by one method, timed the same way for ours, transformers' and llama.cpp's: greedy,
or every one sampled at the bench's temperature and seed.

Every runner returns a raw run record (the fields summary.py reads) plus the emitted token ids.
Decoding is timed whole on both sides, each step with all its work (not only the model calls), and the prompt's
prefill is left out: ours times it apart. transformers' generate has no such split, so a stopping criterion,
which it asks after every step, marks when each step ended; the first step is the prompt's prefill (with, for the
assisted peers, the first round), and the peer is timed from its end to the last step's, at that rate for every
token it emitted. llama.cpp's server (lcpp-*) times itself the same way: its predicted_per_second is the tokens after
the first over the seconds after the first, at which rate every token it emitted counts.
"""
from __future__ import annotations

import copy
import re
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.generation import StoppingCriteria, StoppingCriteriaList

from draftwise.bench.llamacpp_server import LlamaServer, ServerSpec, source_of
from draftwise.config import DEFAULT_DRAFT_TOKENS, DEFAULT_LOOKUP_NGRAM
from draftwise.engine import Engine
from draftwise.errors import DraftwiseError
from draftwise.grammar import Grammar
from draftwise.loading import QUANT_ASSEMBLY, on_target_kernels
from draftwise.methods import BASELINE, DRAFT_MODEL, METHODS as TABLE, OWN_LAYERS, TRAINED_HEAD, methods_needing, needs
from draftwise.tokenizers import CROSS_TOKENIZER, draft_path

OURS = (BASELINE, *(name for name in TABLE if name != BASELINE))  # the table's, the baseline first (report order)
# Bench-only baselines: transformers' generate, and llama.cpp's llama-server on the GGUF files as published.
PEER_HELP = {
    "hf-plain": "transformers' generate, the target alone",
    "hf-assisted": "transformers' assisted generation with the draft model (its own draft-length defaults)",
    "hf-lookup": "transformers' prompt lookup (prompt_lookup_num_tokens = --num-draft-tokens)",
    "lcpp-plain": "llama.cpp's llama-server on the target's GGUF file, no speculation",
    "lcpp-draft": "llama-server speculating with the draft's GGUF file (--spec-type draft-simple, llama.cpp's own "
                  "draft length)",
    "lcpp-ngram": "llama-server's n-gram speculation (--spec-type ngram-mod, llama.cpp's own settings)",
    "lcpp-hybrid": "llama-server's chained speculation: n-grams first, the draft's GGUF file where they find "
                   "nothing (--spec-type ngram-mod,draft-simple)",
}
LCPP_PEERS = ("lcpp-plain", "lcpp-draft", "lcpp-ngram", "lcpp-hybrid")
# llama-server's --spec-type per peer (None: plain decoding), and the peers that draft with the draft's file.
LCPP_SPEC_TYPES = {"lcpp-plain": None, "lcpp-draft": "draft-simple", "lcpp-ngram": "ngram-mod",
                   "lcpp-hybrid": "ngram-mod,draft-simple"}
LCPP_WITH_DRAFT = ("lcpp-draft", "lcpp-hybrid")
PEERS = ("hf-plain", "hf-assisted", "hf-lookup", *LCPP_PEERS)
METHODS = OURS + PEERS
NEEDS_DRAFT = (*methods_needing(DRAFT_MODEL), "hf-assisted", *LCPP_WITH_DRAFT)
NEEDS_LOADED_DRAFT = tuple(m for m in NEEDS_DRAFT if m not in LCPP_PEERS)  # the lcpp-* run the draft's file
# What only speculation has: None for plain decoding (and for the peers, which do not expose it).
SPECULATION_FIELDS = ("proposed", "accepted", "nodes", "rounds", "proposed_at", "accepted_at", "draft_s")


def check_methods(methods: list[str], has_draft: bool) -> None:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise DraftwiseError(f"unknown bench method {unknown[0]!r}; choose from: {', '.join(METHODS)}")
    needs = [m for m in methods if m in NEEDS_DRAFT]
    if needs and not has_draft:
        raise DraftwiseError(f"method {needs[0]!r} needs a draft model (--draft NAME, folder or .gguf path)")
    if not methods:
        raise DraftwiseError(f"give at least one method; choose from: {', '.join(METHODS)}")


class Runners:
    """The loaded models, shared by every method so that all of them run on the very same weights."""

    def __init__(self, target_model, tokenizer, draft_model=None, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
                 head: str | None = None, lookup_ngram: int = DEFAULT_LOOKUP_NGRAM, adaptive: bool = True,
                 lcpp: LlamaCppPeers | None = None, quantized: bool = False, batch_invariant: bool | None = None,
                 jump_forward: bool = True, draft_tokenizer=None, temperature: float = 0.0,
                 seed: int | None = None):
        """head: the trained head's folder, for the methods that need one. lookup_ngram: prompt lookup's longest
        n-gram, ours (hf-lookup keeps transformers' own). adaptive False: ours draft exactly num_draft_tokens.
        lcpp: llama.cpp's servers, for the lcpp-* methods (closed by close()). quantized: the models' linears are
        on their GGUF blocks (the quant backend): no kernels to time, no compact draft. batch_invariant: ours on
        batch-invariant kernels (None: the default, loading.resolve_invariance). jump_forward: under a prompt's
        schema, ours draft the tokens it forces. draft_tokenizer: the draft's own, where it may differ from the
        target's (the pair check then decides; transformers' assisted generation gets both tokenizers).
        temperature above 0: every method samples, from softmax(logits / temperature) over the whole vocabulary,
        each run seeded with seed (ours through generate, transformers' through torch's global generator,
        llama.cpp's through its request)."""
        self.target_model = target_model  # as loaded: what transformers' methods run on
        self.draft_model = draft_model
        # transformers' assisted generation needs both tokenizers for a draft with another (its universal mode)
        self._assistant_tokenizers = {} if draft_tokenizer is None or \
            draft_path(tokenizer, draft_tokenizer) != CROSS_TOKENIZER else {"tokenizer": tokenizer,
                                                                             "assistant_tokenizer": draft_tokenizer}
        self.draft_tokenizer = draft_tokenizer
        self.num_draft_tokens = num_draft_tokens
        self.lookup_ngram, self.adaptive, self.jump_forward = lookup_ngram, adaptive, jump_forward
        # Ours run on one copy of the target on its calibrated kernels (made once: each is gigabytes).
        self.quantized = quantized
        self.fast_target, self.batch_invariant, _ = on_target_kernels(target_model, batch_invariant, None, None)
        self.tokenizer = tokenizer
        self.head = head
        self._engines: dict[str, Engine] = {}  # made on first use: "skip" calibrates at load
        self.temperature, self.seed = temperature, seed
        self._peer_config = _peer_config(target_model.generation_config.pad_token_id, temperature)
        self.lcpp = lcpp

    def close(self) -> None:
        """Stop what runs outside this process (llama.cpp's servers)."""
        if self.lcpp is not None:
            self.lcpp.close()

    def engines(self, methods, dtype: str) -> dict[str, str]:
        """{method: the engine and kernels it ran on}, for the report."""
        import transformers

        ours = f"draftwise on PyTorch {torch.__version__}, {dtype} weights, " + (
            "batch-invariant kernels" if self.batch_invariant else "kernels timed and chosen at load")
        if self.quantized:
            from draftwise.backends import qgemm

            ours = (f"draftwise on PyTorch {torch.__version__}, the GGUF files' own blocks on draftwise's integer "
                    f"kernel (qgemm.c, its {qgemm.kernel_isa()} path), float32 elsewhere")
        theirs = f"transformers {transformers.__version__} generate on PyTorch {torch.__version__}, {dtype} weights"
        return {m: self.lcpp.engine(m) if m in LCPP_PEERS and self.lcpp is not None else
                theirs if m in PEERS else ours for m in methods}

    @property
    def draft_in_use(self):
        """The draft model as the 'draft' method runs it (compact), or None without one."""
        return self.engine("draft").proposer.backend.model if self.draft_model is not None else None

    def engine(self, method: str) -> Engine:
        """The engine that runs method. The methods that run on the target's own layers (skip, hybrid-skip) share
        one: each would hold its own int8 copies of them (1.5 GiB for the 1.5B), and one such engine serves them all
        (Engine.methods_available)."""
        method = methods_needing(OWN_LAYERS)[0] if needs(method, OWN_LAYERS) else method
        if method not in self._engines:
            draft = self.draft_model if method in NEEDS_DRAFT else None
            own_tokenizer = {"draft_tokenizer": self.draft_tokenizer} if draft is not None else {}
            # The head reads the output layer's plain weight and skip copies the plain linears, which the fast
            # copy has repacked.
            head = {"head": self.head} if needs(method, TRAINED_HEAD) else {}
            quant = QUANT_ASSEMBLY if self.quantized else {}
            self._engines[method] = Engine.from_models(self.fast_target, self.tokenizer, draft, method=method,
                                                       loaded_model=self.target_model,
                                                       lookup_max_ngram=self.lookup_ngram,
                                                       batch_invariant=self.batch_invariant, **head, **quant,
                                                       **own_tokenizer)
        return self._engines[method]

    def run(self, method: str, prompt_ids: list[int], max_new_tokens: int,
            schema: dict | None = None) -> tuple[dict, list[int]]:
        """One generation (greedy, or at the temperature): max_new_tokens exactly (EOS ignored), or, under a JSON
        schema, to its end (EOS) or max_new_tokens."""
        if method in OURS:
            return self._run_ours(method, prompt_ids, max_new_tokens, schema)
        if method in LCPP_PEERS:
            if self.lcpp is None:
                raise DraftwiseError(f"{method} needs llama.cpp's GGUF files (Runners made without lcpp)")
            return self.lcpp.run(method, prompt_ids, max_new_tokens, schema, self.temperature, self.seed)
        if schema is not None:
            raise DraftwiseError(f"{method} cannot run a prompt with a schema: transformers' generate has no "
                                 "grammar; leave the hf-* methods out of a structured bench")
        return self._run_peer(method, prompt_ids, max_new_tokens)

    def _run_ours(self, method: str, prompt_ids: list[int], max_new_tokens: int,
                  schema: dict | None) -> tuple[dict, list[int]]:
        grammar = None if schema is None else Grammar.json_schema(schema, jump_forward=self.jump_forward)
        result = self.engine(method).generate(
            prompt_ids, max_new_tokens=max_new_tokens, num_draft_tokens=self.num_draft_tokens,
            ignore_eos=grammar is None, method=method, adaptive=self.adaptive, grammar=grammar,
            temperature=self.temperature, seed=self.seed,
        )
        fields = ("new_tokens", "decode_s", "tokens_per_s", "target_forwards", "verify_s", *SPECULATION_FIELDS)
        record = {name: getattr(result.stats, name) for name in fields}
        if method == BASELINE:
            record.update(dict.fromkeys(SPECULATION_FIELDS))
        return record, result.token_ids

    def _run_peer(self, method: str, prompt_ids: list[int], max_new_tokens: int) -> tuple[dict, list[int]]:
        extra = {}
        config = copy.copy(self._peer_config)
        config.max_new_tokens = max_new_tokens
        if method == "hf-assisted":
            extra["assistant_model"] = self.draft_model  # transformers' own defaults for draft length
            extra.update(self._assistant_tokenizers)
        elif method == "hf-lookup":
            config.prompt_lookup_num_tokens = self.num_draft_tokens
        input_ids = torch.tensor([prompt_ids], device=self.target_model.device)  # [1, prompt]
        # An explicit mask: without one, generate masks every pad id, and chat templates contain it.
        attention_mask = torch.ones_like(input_ids)
        if self.temperature > 0:  # generate takes no generator: it samples from torch's global one, seeded here
            torch.manual_seed(self.seed) if self.seed is not None else torch.seed()
        with _timed_calls(self.target_model) as target, _timed_calls(extra.get("assistant_model")) as draft:
            steps = _StepMarks(input_ids.device, target, draft)
            with torch.inference_mode(), _quiet_transformers(), _own_defaults(self.target_model, self.draft_model):
                output = self.target_model.generate(input_ids, attention_mask=attention_mask, generation_config=config,
                                                    stopping_criteria=StoppingCriteriaList([steps]), **extra)
        token_ids = output[0, len(prompt_ids):].tolist()
        return _peer_record(method, len(token_ids), steps.marks, target, draft), token_ids


@dataclass(frozen=True)
class GgufFiles:
    """The files llama.cpp runs: the target's GGUF, and the draft's for lcpp-draft and lcpp-hybrid (None without
    a draft)."""
    target: Path
    draft: Path | None = None


class LlamaCppPeers:
    """One llama-server per lcpp-* method, started on first use (the warm-up: loading is never timed) and kept
    running until close(), so the methods interleave with ours like any other. Each runs on threads threads,
    the cores ours use."""

    def __init__(self, files: GgufFiles, threads: int | None = None, binary: Path | None = None):
        self.files, self.threads, self.binary = files, threads, binary
        self._servers: dict[str, LlamaServer] = {}
        self._engines: dict[str, str] = {}

    def spec(self, method: str) -> ServerSpec:
        if method in LCPP_WITH_DRAFT:
            if self.files.draft is None:
                raise DraftwiseError(f"{method} needs the draft's GGUF file (--draft NAME or --draft-gguf PATH)")
            return ServerSpec(self.files.target, draft=self.files.draft, spec_type=LCPP_SPEC_TYPES[method],
                              threads=self.threads)
        return ServerSpec(self.files.target, spec_type=LCPP_SPEC_TYPES[method], threads=self.threads)

    def server(self, method: str) -> LlamaServer:
        if method not in self._servers:
            server = LlamaServer(self.spec(method), binary=self.binary)
            server.start()
            self._servers[method] = server
            self._engines[method] = _lcpp_engine(server)
        return self._servers[method]

    def run(self, method: str, prompt_ids: list[int], max_new_tokens: int, schema: dict | None = None,
            temperature: float = 0.0, seed: int | None = None) -> tuple[dict, list[int]]:
        completion = self.server(method).complete(prompt_ids, max_new_tokens, schema, temperature, seed)
        return _lcpp_record(method, completion), completion.token_ids[:max_new_tokens]

    def engine(self, method: str) -> str:
        return self._engines.get(method, "llama.cpp llama-server (not started)")

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()


def _lcpp_record(method: str, completion) -> dict:
    """A llama-server generation as a run record. Each target pass emits the draft tokens it kept and one of its
    own (the first token's pass is the prompt's), so the passes are the tokens less the kept drafts."""
    new_tokens = len(completion.token_ids)
    rate = completion.tokens_per_s
    record = {"new_tokens": new_tokens, "decode_s": new_tokens / rate if rate else None, "tokens_per_s": rate,
              "verify_s": None, **dict.fromkeys(SPECULATION_FIELDS)}
    if method == "lcpp-plain":
        record["target_forwards"] = new_tokens
    else:
        # (llama-server leaves the draft counts out of its timings when nothing was drafted)
        proposed, accepted = completion.draft_n or 0, completion.draft_accepted or 0
        record.update(target_forwards=new_tokens - accepted, proposed=proposed, accepted=accepted)
    return record


def _lcpp_engine(server: LlamaServer) -> str:
    """The engine and kernels of a running llama-server: its build, the file and its quantization, and the CPU
    features its kernels use (llama.cpp's system_info, from its log)."""
    props = server.props()
    spec = server.spec
    files = spec.model.name + (f" with draft {spec.draft.name}" if spec.draft is not None else "")
    text = (f"llama.cpp llama-server {props.get('build_info', '?')} ({source_of(server.binary)}), {files} "
            f"({props.get('model_ftype') or 'type unknown'})")
    if spec.spec_type:
        text += f", --spec-type {spec.spec_type}"
    info = server.system_info()
    return text + (f"; {_cpu_features(info)}" if info else "")


def _cpu_features(system_info: str) -> str:
    """llama.cpp's system_info ('n_threads = 2 (...) / 2 | CPU : AVX = 1 | AVX2 = 1 | REPACK = 1 | ...') as
    '2 threads, CPU: AVX, AVX2, REPACK': the features its kernels use, without the table-breaking bars."""
    threads = re.search(r"n_threads = (\d+)", system_info)
    features = [name for name, on in re.findall(r"(\w+) = (\d+)", system_info)
                if on != "0" and name not in ("n_threads", "n_threads_batch")]
    return (f"{threads.group(1)} threads, " if threads else "") + "CPU: " + ", ".join(features)


@dataclass(frozen=True)
class StepMark:
    """The end of one of generate's steps: when (seconds), the text's length then, and each model's calls so far."""
    at: float
    length: int
    target_calls: int
    draft_calls: int


class _StepMarks(StoppingCriteria):
    """A stopping criterion that never stops: generate asks it after every step, so it marks each step's end."""

    def __init__(self, device: torch.device, target_calls: list, draft_calls: list):
        self.device, self.target_calls, self.draft_calls = device, target_calls, draft_calls
        self.marks: list[StepMark] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self.device.type == "cuda":  # the step's kernels done (generate waits for them here anyway, to check EOS)
            torch.cuda.synchronize(self.device)
        self.marks.append(StepMark(time.perf_counter(), input_ids.shape[1], len(self.target_calls),
                                   len(self.draft_calls)))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # [B]: none finished


def _peer_record(method: str, new_tokens: int, marks: list[StepMark], target: list[float], draft: list[float]) -> dict:
    """The run record of a peer's generation: its decoding timed from the end of its first step (the prompt's prefill,
    and for hf-assisted the first round verified with it) to the end of its last, at that rate for all new_tokens, as
    ours is timed over all of its own; each model's seconds likewise at its rate a call after the first step, for all
    its calls. A first step that emitted every token leaves no decoding to time: decode_s is None (the summary leaves
    the prompt out). target, draft: each model call's seconds, in order."""
    first, last = marks[0], marks[-1]
    timed_tokens = last.length - first.length
    decode_s = new_tokens / timed_tokens * (last.at - first.at) if timed_tokens else None
    record = {
        "new_tokens": new_tokens, "decode_s": decode_s, "tokens_per_s": new_tokens / decode_s if decode_s else None,
        "target_forwards": len(target), "verify_s": _at_later_rate(target, first.target_calls),
        **dict.fromkeys(SPECULATION_FIELDS),
    }
    if method == "hf-assisted":
        # Each assistant call proposes one token, and each target pass keeps the accepted ones plus its own.
        record.update(proposed=len(draft), accepted=new_tokens - len(target), rounds=len(target),
                      draft_s=_at_later_rate(draft, first.draft_calls))
    return record


def _at_later_rate(calls: list[float], first_step_calls: int) -> float | None:
    """The seconds of all the calls, at the mean of those after the first step's (None when there are none: the
    first step was the last)."""
    later = calls[first_step_calls:]
    return sum(later) / len(later) * len(calls) if later else None


def _peer_config(pad_token_id: int | None, temperature: float = 0.0) -> GenerationConfig:
    """Greedy, or sampled at temperature over the whole vocabulary (no top-k or top-p: transformers' own top-k of
    50 is turned off, as ours and llama.cpp's sample), with an end-of-sequence id that no token has, so every method
    emits exactly max_new_tokens (transformers falls back to the model's EOS when the field is None; -1 matches no
    token)."""
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    return GenerationConfig(**sampling, eos_token_id=-1, pad_token_id=0 if pad_token_id is None else pad_token_id)


@contextmanager
def _own_defaults(*models):
    """generate on transformers' own defaults, not the models' generation_config.json: it fills every field the
    given config leaves unset from the model's, and one may add a repetition penalty, beams or other processors
    that ours do not apply, which would change the peer's text and its cost a step."""
    saved = [(model, model.generation_config) for model in models if model is not None]
    try:
        for model, config in saved:
            model.generation_config = type(config)()  # (a model may have a class of its own)
        yield
    finally:
        for model, config in saved:
            model.generation_config = config


@contextmanager
def _quiet_transformers():
    """transformers warns on every call that EOS -1 never stops generation: that is the point here."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


@contextmanager
def _timed_calls(model):
    """Yield a list that receives the wall time of each forward call of model (or stays empty for None)."""
    durations: list[float] = []
    if model is None:
        yield durations
        return
    started: list[float] = []
    pre = model.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
    post = model.register_forward_hook(lambda *_: durations.append(time.perf_counter() - started.pop()))
    try:
        yield durations
    finally:
        pre.remove()
        post.remove()


def measure_roofline(model, sizes=(1, 2, 4, 8, 16), context: int = 200, rounds: int = 7) -> dict[str, float]:
    """Median ms of one forward of n new tokens after a context-token prefill: what a verification pass costs.
    Each round runs every width once (a first round warms each shape up), so a busy spell of the machine falls on
    the widths alike: three passes of one width back to back once read a 4-token pass dearer than an 8-token one."""
    from draftwise.backends.hf import HFBackend

    backend = HFBackend(model)
    vocab = min(backend.vocab_size, 1000)
    prompt = [(7 * i + 3) % vocab for i in range(context)]
    backend.prefill(prompt)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for round_ in range(rounds + 1):
        for n in sizes:
            started = time.perf_counter()
            backend.forward(prompt[:n])
            if round_:
                times[n].append(time.perf_counter() - started)
            backend.trim(context)
    return {str(n): 1000 * statistics.median(times[n]) for n in sizes}
