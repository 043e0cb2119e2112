"""`draftwise bench`: every method on the same loaded models and prompts, interleaved, then the three outputs.

Order of work: choose prompts; measure the machine's read rate (bandwidth.py); then for each dtype, load the models
once in it, warm every method up (untimed), run prompt by prompt with the methods interleaved, in pairs of repeats
whose second runs the first's order backwards, each pair rotated (no method always runs first, after a particular
other, or on a cooler machine), mark which outputs equal the reference greedy output of that dtype (greedy runs
only: sampled texts follow one distribution, they are not equal), measure the roofline, summarize, set each plain
step beside its bandwidth bound; last, write results.json, the plots and report.md for every dtype at once. Each
prompt's runs go to a journal under the output folder as the prompt finishes, so --resume after a crash runs only
the prompts that had not (see journal.py).
"""
from __future__ import annotations

import gc
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from draftwise.bench.bandwidth import best_read, bound_ms, measure_read_rate
from draftwise.bench.interleave import order_for_repeat
from draftwise.bench.journal import Journal, code_version, settings_of
from draftwise.bench.plots import write_plots
from draftwise.bench.prompts import BenchPrompt, categories_of, default_prompts, load_prompts, select_prompts
from draftwise.bench.report import write_report
from draftwise.bench.runners import (LCPP_PEERS, LCPP_WITH_DRAFT, METHODS, NEEDS_LOADED_DRAFT, OURS, GgufFiles,
                                     LlamaCppPeers, Runners, check_methods, measure_roofline)
from draftwise.bench.summary import ALL, summarize
from draftwise.config import (DEFAULT_DRAFT_TOKENS, DEFAULT_LOOKUP_NGRAM, DEFAULT_MAX_NEW_TOKENS, DTYPES,
                              MAX_DRAFT_TOKENS, SamplingConfig)
from draftwise.errors import DraftwiseError
from draftwise.methods import BASELINE, TRAINED_HEAD, methods_needing
from draftwise.files import prepare_out
from draftwise.hardware import resolve_dtype
from draftwise.tokenizers import encode_prompt

HEAD_METHODS = methods_needing(TRAINED_HEAD)
# Every method but those needing a trained head or a llama-server build (opt-in: `make llama-server`).
DEFAULT_METHODS = tuple(m for m in METHODS if m not in HEAD_METHODS and m not in LCPP_PEERS)
# A pass that runs the quant backend: the models' linears on their GGUF files' own blocks (float32 around them).
GGUF_PASS = "gguf"
AUTO = "auto"  # the backend generate and serve run by default (loading.auto_backend), in its dtype
WARMUP_TOKENS = 8
LCPP_RANDOM_SEED = 2**32 - 1  # llama.cpp's seeds are 32 bits, and this one draws a random seed
PLAIN_METHODS = (BASELINE, "hf-plain", "lcpp-plain")  # a plain decoding step each: what the bandwidth bound bounds


@dataclass(frozen=True)
class BenchConfig:
    target: str
    draft: str | None = None
    methods: tuple[str, ...] = DEFAULT_METHODS
    categories: str = "all"
    per_category: int | None = 3
    limit: int | None = None
    prompts_file: str | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    repeats: int = 3
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS
    lookup_ngram: int = DEFAULT_LOOKUP_NGRAM  # prompt lookup's longest n-gram, ours
    fixed_k: bool = False  # ours draft exactly num_draft_tokens every round
    dtype: str = "float32"  # one dtype per config: a bench over several is one config each (per_dtype)
    device: str = "cpu"
    out: str = "bench-results"
    roofline: bool = True
    progress: bool = True
    head: str | None = None  # the trained head for head and hybrid-head; None: where train-head puts the target's
    resume: bool = False  # keep the finished prompts of an earlier bench of these settings under out
    target_gguf: str | None = None  # the GGUF files llama.cpp runs (lcpp-*); None: the target's and draft's own
    draft_gguf: str | None = None
    batch_invariant: bool | None = None  # ours on batch-invariant kernels; None: the default (loading.resolve_invariance)
    jump_forward: bool = True  # under a prompt's schema, ours draft the tokens it forces (grammar.py)
    temperature: float = 0.0  # 0: greedy; above: every method samples at it (top-k 0, top-p 1), each run seeded
    seed: int | None = 0
    chosen_by_auto: bool = False  # this pass is what --dtype auto chose (per_dtype): the backend users run

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    @property
    def head_folder(self) -> str:
        from draftwise.models import head_home

        return self.head or str(head_home(self.target))

    def check(self) -> None:
        check_methods(list(self.methods), self.draft is not None)
        if set(HEAD_METHODS) & set(self.methods):
            from draftwise.proposers.head_model import require_head

            require_head(self.head_folder)
        for name in ("max_new_tokens", "repeats", "num_draft_tokens", "lookup_ngram"):
            if getattr(self, name) < 1:
                raise DraftwiseError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.num_draft_tokens > MAX_DRAFT_TOKENS:
            raise DraftwiseError(f"num-draft-tokens must be between 1 and {MAX_DRAFT_TOKENS}, "
                                 f"got {self.num_draft_tokens}")
        SamplingConfig(temperature=self.temperature, seed=self.seed).check()
        if self.seed is not None and not 0 <= self.seed < LCPP_RANDOM_SEED:
            raise DraftwiseError(f"seed must be from 0 to {LCPP_RANDOM_SEED - 1} (the bench gives llama.cpp the same "
                                 f"seed, a 32-bit one whose {LCPP_RANDOM_SEED} means random), got {self.seed}")
        if uses_lcpp(self):
            from draftwise.bench.llamacpp_server import server_binary

            server_binary()
            gguf_files(self)


def choose_prompts(cfg: BenchConfig) -> list[BenchPrompt]:
    prompts = load_prompts(cfg.prompts_file) if cfg.prompts_file else default_prompts()
    return select_prompts(prompts, cfg.categories, cfg.per_category, cfg.limit)


def per_dtype(cfg: BenchConfig, names: Sequence[str], auto: Callable[[BenchConfig], str] | None = None
              ) -> list[BenchConfig]:
    """cfg once per distinct dtype that names resolve to on cfg.device, in the order given.

    'auto' is what `generate` and `serve` run by default (auto_pass: the quant backend's pass, gguf, where
    loading.auto_backend picks it, else hf in the dtype the hardware computes); auto: that choice (tests give
    their own). Resolving first runs 'auto' and what it stands for once, records what actually ran (and which
    pass auto chose), and fails on an unknown name before any model loads.
    """
    if not names:
        raise DraftwiseError(f"dtype: give at least one of {', '.join(DTYPES)}, or {GGUF_PASS}")
    for name in names:  # an unknown name fails before auto resolves models
        if name not in (GGUF_PASS, AUTO):
            resolve_dtype(name, cfg.device)
    chosen = (auto or auto_pass)(cfg) if AUTO in names else None
    dtypes = dict.fromkeys(name if name == GGUF_PASS else chosen if name == AUTO else resolve_dtype(name, cfg.device)
                           for name in names)
    return [replace(cfg, dtype=dtype, chosen_by_auto=dtype == chosen) for dtype in dtypes]


def auto_pass(cfg: BenchConfig) -> str:
    """The pass --dtype auto runs: gguf (the quant backend) where loading.auto_backend picks quant for the target,
    the draft the methods load and every draftwise method named, as `generate` and `serve` would; else the dtype
    hf's auto resolves to. (It resolves the models: a known name not yet pulled is pulled here, as generate does.)"""
    from draftwise.loading import auto_backend

    draft = cfg.draft if uses_draft(cfg) else None
    ours = [m for m in cfg.methods if m in OURS] or [BASELINE]
    quant = all(auto_backend(cfg.target, draft, method, cfg.device, cfg.progress, "auto", cfg.batch_invariant)
                == "quant" for method in ours)
    return GGUF_PASS if quant else resolve_dtype("auto", cfg.device)


def run_bench(cfg: BenchConfig, command: str = "", models=None) -> dict:
    """Run the benchmark in cfg.dtype and write its outputs under cfg.out.

    models: (target, tokenizer, draft) already loaded; loaded from cfg when None.
    """
    return run_per_dtype(per_dtype(cfg, [cfg.dtype]), command, load=lambda c: models or load_models(c))


def run_per_dtype(configs: Sequence[BenchConfig], command: str = "",
                  load: Callable[[BenchConfig], tuple] | None = None) -> dict:
    """The whole bench once per config (the same settings in another dtype, as per_dtype makes them), models
    loaded by load(config) once each; results.json, the plots and report.md under configs[0].out cover them all."""
    for cfg in configs:
        cfg.check()
    prompts = choose_prompts(configs[0])
    out = prepare_out(configs[0].out)
    journal = Journal.open(out, journal_settings(configs, prompts), configs[0].resume)
    load = load or load_models
    started, started_clock = time.strftime("%Y-%m-%d %H:%M:%S"), time.perf_counter()
    # The machine's read rate, before any model takes memory and again once they are freed: on the threads ours and
    # llama.cpp's run; the better reading bounds the steps.
    read = measure_read_rate(torch.get_num_threads()) if configs[0].roofline else None
    passes = []
    for cfg in configs:
        passes.append(_bench_pass(cfg, prompts, load(cfg), journal))
        gc.collect()  # the pass's models may sit in reference cycles: free them before the next dtype loads
    if read is not None:
        read = best_read(read, measure_read_rate(torch.get_num_threads()))
    results = {
        "meta": {**_meta(configs, command, prompts), "started": started,
                 "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "wall_seconds": round(time.perf_counter() - started_clock, 1),
                 "resumed_prompts": {p["dtype"]: p["resumed"] for p in passes}},
        "roofline": {p["dtype"]: p["roofline"] for p in passes},
        "engines": {p["dtype"]: p["engines"] for p in passes},
        "bandwidth": {"read": read, "bounds": {p["dtype"]: with_bounds(p["plain_steps"], read) for p in passes}},
        "runs": [run for p in passes for run in p["runs"]],
        "summary": [row for p in passes for row in p["summary"]],
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plots = write_plots(results, out)
    write_report(results, out, plots)
    journal.close()
    return results


def _bench_pass(cfg: BenchConfig, prompts, models, journal: Journal) -> dict:
    """Every method on models loaded in cfg.dtype: its runs, roofline and summary rows, each run and row tagged;
    resumed: how many prompts' runs came from the journal instead of running here."""
    target_model, tokenizer, draft_model, *draft_tokenizer = models  # (the draft's own tokenizer, where given)
    # llama.cpp on the cores ours use: as many threads as torch runs.
    lcpp = LlamaCppPeers(gguf_files(cfg), threads=torch.get_num_threads()) if uses_lcpp(cfg) else None
    runners = Runners(target_model, tokenizer, draft_model, cfg.num_draft_tokens, draft_tokenizer=next(iter(draft_tokenizer), None),
                      head=cfg.head_folder if set(HEAD_METHODS) & set(cfg.methods) else None,
                      lookup_ngram=cfg.lookup_ngram, adaptive=not cfg.fixed_k, lcpp=lcpp,
                      quantized=cfg.dtype == GGUF_PASS, batch_invariant=cfg.batch_invariant,
                      jump_forward=cfg.jump_forward, temperature=cfg.temperature, seed=cfg.seed)
    encoded = [encode_prompt(tokenizer, p.text, chat=bool(getattr(tokenizer, "chat_template", None))) for p in prompts]

    try:  # llama.cpp's servers are processes of their own: stopped whatever happens
        _warm_up(runners, cfg.methods, encoded[0])
        runs, resumed = _interleaved_runs(runners, cfg, prompts, encoded, journal)
        engines = runners.engines(cfg.methods, cfg.dtype)
    finally:
        runners.close()
    _mark_identical(runs, cfg.methods, cfg.sampled)
    roofline = _roofline(runners) if cfg.roofline else None
    summary = [{"dtype": cfg.dtype, **row} for row in summarize(runs, roofline)]
    steps = _plain_steps(cfg, runners, summary, roofline) if cfg.roofline else None
    return {"dtype": cfg.dtype, "roofline": roofline, "runs": runs, "summary": summary, "resumed": resumed,
            "engines": engines, "plain_steps": steps}


def load_models(cfg: BenchConfig):
    """(target, tokenizer, draft or None, the draft's tokenizer or None): the draft only when a method needs it."""
    from draftwise.loading import load_models as load

    quantized = cfg.dtype == GGUF_PASS
    return load(cfg.target, cfg.draft if uses_draft(cfg) else None, "float32" if quantized else cfg.dtype, cfg.device,
                cfg.progress, quantized)


def uses_draft(cfg: BenchConfig) -> bool:
    """Whether a method runs the loaded draft model (lcpp-draft and lcpp-hybrid run the draft's GGUF file)."""
    return any(m in NEEDS_LOADED_DRAFT for m in cfg.methods)


def uses_lcpp(cfg: BenchConfig) -> bool:
    return any(m in LCPP_PEERS for m in cfg.methods)


def gguf_files(cfg: BenchConfig) -> GgufFiles:
    """The GGUF files the lcpp-* methods run: the paths given, else the target's and draft's own (a .gguf, or the
    file the model store keeps); the draft's only when lcpp-draft or lcpp-hybrid runs."""
    from draftwise.bench.llamacpp_server import find_gguf

    draft = None
    if set(LCPP_WITH_DRAFT) & set(cfg.methods):
        draft = find_gguf(cfg.draft, cfg.draft_gguf, "--draft-gguf")
    return GgufFiles(find_gguf(cfg.target, cfg.target_gguf, "--target-gguf"), draft)


def _warm_up(runners: Runners, methods, prompt_ids: list[int]) -> None:
    # First calls allocate buffers and pick kernels; none of that belongs in a measurement.
    for method in methods:
        runners.run(method, prompt_ids, WARMUP_TOKENS)


def _interleaved_runs(runners: Runners, cfg: BenchConfig, prompts, encoded, journal: Journal) -> tuple[list[dict], int]:
    """(every run, prompt by prompt, the journal's finished prompts taken as they stand; how many those were)."""
    runs, resumed = [], 0
    total = len(prompts) * cfg.repeats * len(cfg.methods)
    bar = tqdm(total=total, desc=f"bench {cfg.dtype}", unit="run", disable=not cfg.progress, dynamic_ncols=True)
    with bar:
        for prompt, prompt_ids in zip(prompts, encoded):
            prompt_runs = journal.runs_of(cfg.dtype, (prompt.category, prompt.question_id))
            if prompt_runs is None:
                prompt_runs = _prompt_runs(runners, cfg, prompt, prompt_ids, bar)
                journal.record(cfg.dtype, prompt_runs)
            else:
                resumed += 1
                bar.update(len(prompt_runs))
            runs += prompt_runs
    return runs, resumed


def _prompt_runs(runners: Runners, cfg: BenchConfig, prompt: BenchPrompt, prompt_ids: list[int], bar) -> list[dict]:
    """Every method on one prompt, every repeat, interleaved (interleave.order_for_repeat)."""
    runs = []
    for repeat in range(cfg.repeats):
        for method in order_for_repeat(cfg.methods, repeat):
            bar.set_postfix_str(f"{prompt.category} #{prompt.question_id} {method}")
            record, token_ids = runners.run(method, prompt_ids, cfg.max_new_tokens, prompt.schema)
            runs.append({"dtype": cfg.dtype, "method": method, "category": prompt.category,
                         "question_id": prompt.question_id, "repeat": repeat,
                         "prompt_tokens": len(prompt_ids), **record, "token_ids": token_ids})
            bar.update()
    return runs


def _mark_identical(runs: list[dict], methods, sampled: bool = False) -> None:
    """identical: the output equals the target-only output of the same prompt (none's, else hf-plain's, greedy);
    the reference run itself is that output. Sampled, our methods are compared with none's: a seeded run draws from
    shared noise (shared_noise.py), so every exact method gives the seed's one text; the peers' are not (None), their
    samplers draw otherwise."""
    reference = next((m for m in ((BASELINE,) if sampled else (BASELINE, "hf-plain")) if m in methods), None)
    expected = {(r["category"], r["question_id"]): r["token_ids"] for r in runs
                if r["method"] == reference and r["repeat"] == 0}
    for run in runs:
        key = (run["category"], run["question_id"])
        compared = reference is not None and not (sampled and run["method"] not in OURS)
        run["identical"] = run["token_ids"] == expected[key] if compared else None


def _plain_steps(cfg: BenchConfig, runners: Runners, summary: list[dict], roofline: dict | None) -> dict[str, dict]:
    """{plain method that ran: its step and the bytes it reads}: the bytes a step reads (bandwidth.py; ours and
    transformers' on the weights as loaded in this dtype, or on the GGUF's blocks in the quant pass; llama.cpp's on
    its GGUF file), the step (all categories' tokens/s inverted) and, for ours, the roofline's one-token pass alone."""
    from draftwise.bench.bandwidth import model_bytes_per_token

    rate = {row["method"]: row["tokens_per_s"] for row in summary if row["category"] == ALL}
    steps = {}
    for method in (m for m in PLAIN_METHODS if m in cfg.methods):
        if method == "lcpp-plain":
            files = gguf_files(cfg)
            of, size = files.target.name, _gguf_bytes(files.target)
        elif cfg.dtype == GGUF_PASS:
            path = _target_gguf(cfg)
            of, size = (path.name if path else "the target's GGUF file"), _gguf_bytes(path)
        else:
            of, size = f"{cfg.dtype} weights as loaded", model_bytes_per_token(runners.target_model)
        steps[method] = {"bytes_per_token": size, "of": of, "step_ms": 1000 / rate[method] if rate.get(method) else None,
                         "pass_ms": (roofline or {}).get("target", {}).get("1") if method == BASELINE else None}
    return steps


def with_bounds(steps: dict[str, dict] | None, read: dict | None) -> dict[str, dict] | None:
    """Each plain step beside the bound its bytes take at the read rate, and their ratios."""
    if steps is None or read is None:
        return None
    bounds = {}
    for method, step in steps.items():
        bound = bound_ms(step["bytes_per_token"], read)
        ratio = {name: step[f"{name}_ms"] / bound if step[f"{name}_ms"] and bound else None for name in ("step", "pass")}
        bounds[method] = {**step, "bound_ms": bound, "step_over_bound": ratio["step"], "pass_over_bound": ratio["pass"]}
    return bounds


def _target_gguf(cfg: BenchConfig) -> Path | None:
    """The target's GGUF file, which the quant pass reads the blocks of (--target-gguf, a .gguf, the store's)."""
    from draftwise.bench.llamacpp_server import LlamaServerError, find_gguf

    try:
        return find_gguf(cfg.target, cfg.target_gguf)
    except LlamaServerError:
        return None


def _gguf_bytes(path: Path | None) -> int | None:
    """The bytes a step reads of a GGUF file, or None where its header cannot be read."""
    from draftwise.bench.bandwidth import gguf_bytes_per_token

    if path is None:
        return None
    try:
        return gguf_bytes_per_token(path)
    except (OSError, ValueError, KeyError):  # not a GGUF file, or a tensor type gguf does not know
        return None


def _roofline(runners: Runners) -> dict:
    """The target and draft as our methods run them (calibrated kernels, compact draft), and the target as
    loaded, which transformers' methods run: the before and after of the kernel choice."""
    draft = runners.draft_in_use
    return {"context": 200, "target": measure_roofline(runners.fast_target),
            "target_as_loaded": measure_roofline(runners.target_model),
            "draft": measure_roofline(draft) if draft is not None else None}


def _meta(configs: Sequence[BenchConfig], command: str, prompts) -> dict:
    """The settings the configs share, and the dtypes that ran, in order (each run and row carries its own)."""
    meta = asdict(configs[0])
    del meta["dtype"], meta["chosen_by_auto"]
    meta.update(
        dtypes=[cfg.dtype for cfg in configs],
        auto_choice=next((cfg.dtype for cfg in configs if cfg.chosen_by_auto), None),
        methods=list(configs[0].methods),
        categories=categories_of(prompts),
        prompts=len(prompts),
        machine=machine_description(),
        code=code_version(),
        command=command,
    )
    return meta


def machine_description() -> str:
    """The machine a bench ran on, the processor named (with its family and model) as every figure needs."""
    import transformers

    from draftwise.hardware import describe_machine

    cpu = describe_machine("cpu")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu['name']}, {cpu['capability']}{', native bfloat16' if cpu['native_bf16'] else ''}, "
            f"{os.cpu_count()} cores, {gpu}, {platform.system()} {platform.machine()}, "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, transformers {transformers.__version__}")


def journal_settings(configs: Sequence[BenchConfig], prompts) -> dict:
    """What the journal's runs depend on (journal.settings_of), on this machine and these model files."""
    return settings_of(configs, prompts, machine_description(), model_files(configs[0]))


def model_files(cfg: BenchConfig) -> dict:
    """What the models and head on disk are, for the journal: a local folder or file by its files' sizes and times
    (it may be retrained or replaced between a crash and --resume); a model of the store by its name alone (its
    weights are checked against a fixed SHA-256)."""
    from draftwise.models.registry import KNOWN_MODELS

    def files_of(name: str | None):
        if name is None or name in KNOWN_MODELS or not os.path.exists(name):
            return None
        root = Path(name)
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        return [[str(p.relative_to(root)) if p != root else p.name, p.stat().st_size, p.stat().st_mtime_ns]
                for p in paths]

    return {"target": files_of(cfg.target), "draft": files_of(cfg.draft if uses_draft(cfg) else None),
            "head": files_of(cfg.head_folder if set(HEAD_METHODS) & set(cfg.methods) else None),
            "target_gguf": files_of(cfg.target_gguf), "draft_gguf": files_of(cfg.draft_gguf)}
