"""`draftwise bench`: its options and its handler (argparse stays in the CLI layer)."""
from __future__ import annotations

import argparse
import json
import shlex
import sys

from draftwise.config import DTYPES

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def add_bench(commands, formatter) -> None:
    from draftwise.bench.run import DEFAULT_METHODS
    from draftwise.bench.runners import METHODS

    p = commands.add_parser(
        "bench",
        formatter_class=formatter,
        help="benchmark draftwise against transformers' generate, per workload",
        description=(
            "Run every method on the same loaded models, dtype and prompts: draftwise's own (none, draft,\n"
            "lookup) and transformers' generate alone (hf-plain), with assistant_model (hf-assisted) and with\n"
            "prompt_lookup_num_tokens (hf-lookup). Greedy, EOS ignored so every method emits the same number\n"
            "of tokens, methods interleaved in one process, a warm-up excluded, prefill excluded.\n"
            "\n"
            "Writes results.json (every run, raw, and a summary row per method and category), report.md (the\n"
            "tables) and two PNG plots under --out. Prompts: the Spec-Bench set (first turn, chat template) by\n"
            "category, plus a code category of completion and edit prompts."
        ),
        epilog=(
            "examples:\n"
            "  draftwise bench --per-category 1 --max-new-tokens 64 --repeats 2 --dtype bfloat16\n"
            "  draftwise bench --methods none,lookup,hf-plain,hf-lookup --categories summarization,code\n"
            "  draftwise bench --prompts my_prompts.jsonl --target ./my-hf-folder --methods none,lookup\n"
            "\n"
            "a run takes about (prompts x methods x (repeats + warm-up)) generations; on 2 CPU cores the default\n"
            "1.5B pair decodes 2 to 8 tokens/s, so start small with --limit or --per-category."
        ),
    )
    models = p.add_argument_group("models")
    models.add_argument("--target", default=DEFAULT_TARGET, metavar="MODEL",
                        help="NAME, Hugging Face folder or .gguf path (default: %(default)s)")
    models.add_argument("--draft", default=DEFAULT_DRAFT, metavar="MODEL",
                        help="draft for 'draft' and 'hf-assisted' (default: %(default)s)")
    models.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="one dtype for every method (default: %(default)s)")
    work = p.add_argument_group("workload")
    work.add_argument("--methods", default=",".join(DEFAULT_METHODS), metavar="M,M,...",
                      help=f"comma-separated, from: {', '.join(METHODS)} (default: all)")
    work.add_argument("--categories", default="all", metavar="C,C,...",
                      help="comma-separated categories, or 'all' (default: %(default)s)")
    work.add_argument("--per-category", type=int, default=3, metavar="N",
                      help="first N prompts of each category (default: %(default)s)")
    work.add_argument("--limit", type=int, metavar="N", help="at most N prompts in all, spread over categories")
    work.add_argument("--prompts", metavar="FILE",
                      help="a JSONL file of {question_id, category, turns} instead of the built-in set")
    work.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                      help="tokens every method generates per prompt (default: %(default)s)")
    work.add_argument("--repeats", type=int, default=3, metavar="N",
                      help="timed runs per prompt and method; the median counts (default: %(default)s)")
    work.add_argument("-k", "--num-draft-tokens", type=int, default=4, metavar="K",
                      help="draft length for draft, lookup and hf-lookup; hf-assisted keeps transformers' own "
                           "(default: %(default)s)")
    work.add_argument("--no-roofline", action="store_true", help="skip the forward-time-per-size measurement")
    out = p.add_argument_group("output")
    out.add_argument("--out", default="bench-results", metavar="DIR", help="folder for the outputs (default: %(default)s)")
    out.add_argument("--json", action="store_true", help="print the summary rows as JSON on stdout")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress bars or loading messages")
    p.set_defaults(func=cmd_bench)


def config_from_args(args: argparse.Namespace):
    from draftwise.bench.run import BenchConfig

    return BenchConfig(
        target=args.target, draft=args.draft, methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        categories=args.categories, per_category=args.per_category, limit=args.limit, prompts_file=args.prompts,
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, num_draft_tokens=args.num_draft_tokens,
        dtype=args.dtype, out=args.out, roofline=not args.no_roofline, progress=not (args.quiet or args.json),
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from draftwise.bench.run import choose_prompts, prepare_out, run_bench

    cfg = config_from_args(args)
    # Everything that can fail without a model fails here, before minutes of loading.
    cfg.check()
    choose_prompts(cfg)
    prepare_out(cfg.out)
    command = "draftwise " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results = run_bench(cfg, command=command, models=load_bench_models(cfg))
    if args.json:
        print(json.dumps(results["summary"], indent=1))
    else:
        print(f"{cfg.out}/report.md")
    return 0


def load_bench_models(cfg):
    """The one place bench loads models (tests replace it with tiny in-memory ones)."""
    from draftwise.bench.run import load_models

    return load_models(cfg)
