"""`draftwise distill` and `draftwise traffic`: the closed loop's commands (argparse stays in the CLI layer)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from draftwise import options
from draftwise.config import DEFAULT_DRAFT, DEFAULT_DRAFT_TOKENS
from draftwise.errors import DraftwiseError
from draftwise.extras import need
from draftwise.train.distill import Recipe
from draftwise.train.traffic import SERVICES

DEFAULTS = Recipe()


def add_distill(commands, formatter) -> None:
    p = commands.add_parser(
        "distill", formatter_class=formatter, help="learn a better draft from a proposal log's traffic",
        description=(
            "Teach the draft to write what the target wrote on your own traffic: the finished requests of one or\n"
            "more proposal logs (`draftwise serve --proposal-log PATH`), each prompt with the target's output,\n"
            "which the server computed while serving (no target pass here). A low-rank adapter (LoRA) on the\n"
            "draft's projections learns from the earlier requests; the latest --held-out share is held out, and\n"
            "the share of the target's tokens the draft's greedy choice matches there is measured before and\n"
            "after. The result is a draft version in the store, NAME@vN, with its provenance and checksums;\n"
            "serve or generate with --draft NAME@vN. A checkpoint is kept as it trains: the same command resumes."),
        epilog="example:\n  draftwise distill traffic.db --draft qwen2.5-coder-0.5b-instruct\n"
               "  draftwise serve --draft qwen2.5-coder-0.5b-instruct@v1")
    p.add_argument("logs", nargs="+", metavar="LOG", help="proposal logs (SQLite files written by serve --proposal-log)")
    options.add_target(p, role="the model the logs' outputs are from (its tokenizer must be the draft's)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, metavar="MODEL",
                   help="the draft to improve: a model name, folder, or a version NAME@vN (default: %(default)s)")
    p.add_argument("--held-out", type=float, default=DEFAULTS.held_out, metavar="SHARE",
                   help="the latest share of the requests, judged on and never trained on (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=DEFAULTS.epochs, metavar="N", help="(default: %(default)s)")
    p.add_argument("--rank", type=int, default=DEFAULTS.rank, metavar="R",
                   help="the adapter's rank (default: %(default)s)")
    p.add_argument("--lr", type=float, default=DEFAULTS.lr, metavar="LR", help="peak learning rate (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=DEFAULTS.seq_len, metavar="N",
                   help="most tokens of a request trained on at once: its output and the prompt before it that fits "
                        "(default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the version's record as one JSON object")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_distill)


def add_traffic(commands, formatter) -> None:
    p = commands.add_parser(
        "traffic", formatter_class=formatter, help="write a simulated service's traffic to distill and judge on",
        description=(
            "Write a simulated service's requests about the third-party packages installed here (never the\n"
            "standard library or a benchmark): 'code', a code assistant asked about their functions (explain it,\n"
            "write tests for it, add type hints, write it from its docstring), or 'docs', a documentation assistant\n"
            "asked about their READMEs' sections (summarize, list the key points, explain to a newcomer, say what\n"
            "it is about). Split by package: OUT/train.jsonl (the earlier traffic, from the first packages) and\n"
            "OUT/eval.jsonl (the later, from the last ones; no file in common). Play them with\n"
            "`draftwise loadgen --prompts OUT/train.jsonl` against a server that keeps a --proposal-log."),
        epilog="examples:\n  draftwise traffic --out traffic --requests 400\n"
               "  draftwise traffic --out docs-traffic --service docs")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder for train.jsonl and eval.jsonl")
    p.add_argument("--requests", type=int, default=400, metavar="N", help="in all (default: %(default)s)")
    p.add_argument("--held-out", type=float, default=0.25, metavar="SHARE",
                   help="the share of the packages (the last ones) and of the requests that are eval's "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="which kind of request each item gets (default: 0)")
    p.add_argument("--service", choices=sorted(SERVICES), default="code",
                   help="the simulated service (default: %(default)s)")
    p.set_defaults(func=cmd_traffic)


def recipe_of(args: argparse.Namespace) -> Recipe:
    for name in ("epochs", "rank", "seq_len"):
        if getattr(args, name) < 1:
            raise DraftwiseError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.lr > 0:
        raise DraftwiseError(f"--lr must be a number > 0, got {args.lr}")
    return Recipe(rank=args.rank, alpha=2.0 * args.rank, lr=args.lr, epochs=args.epochs, seq_len=args.seq_len,
                  held_out=args.held_out)


def cmd_distill(args: argparse.Namespace) -> int:
    from draftwise.loading import load_model, load_tokenizer
    from draftwise.models import resolve
    from draftwise.models.store import store_home
    from draftwise.models.versions import apply_version, drafts_home, save_version, split_version
    from draftwise.serve.proposal_log import connect
    from draftwise.tokenizers import check_same_tokenizer
    from draftwise.train.distill import distill, run_key
    from draftwise.train.served import served_requests, time_split

    need("train", what="draftwise distill")
    recipe = recipe_of(args)
    for path in args.logs:
        connect(Path(path)).close()  # a missing or wrong log fails now, before a model loads
    train, _ = time_split(served_requests(args.logs), recipe.held_out)  # too little traffic fails now too
    progress = not args.quiet
    draft_source, target_source = resolve(args.draft, progress=progress), resolve(args.target, progress=progress)
    check_same_tokenizer(load_tokenizer(str(target_source.path), target_source.gguf_file),
                         load_tokenizer(str(draft_source.path), draft_source.gguf_file))
    weights = draft_source.float_weights(progress)  # training reads floats: the store's float copy, made once
    model = load_model(str(weights.path), weights.gguf_file, "float32", "cpu", progress)
    if draft_source.adapter is not None:
        model = apply_version(model, draft_source.adapter)  # a version improves on its own weights
    base = split_version(args.draft)[0]  # a version's successor is a version of the same base
    work = store_home() / "tmp" / f"distill-{drafts_home(base).name}-{run_key(train, args.draft, recipe)}"
    log = (lambda line: print(line, file=sys.stderr, flush=True))
    trained, outcome = distill(model, args.draft, args.logs, recipe, work, progress=progress, log=log)
    provenance = {"from": args.draft, "target": args.target, **asdict(outcome)}
    name, folder = save_version(base, trained.save_pretrained, provenance)
    _remove(work)
    if args.json:
        print(json.dumps({"version": name, "folder": str(folder), **provenance}))
    else:
        print(name)
        log(f"{folder}: held-out agreement {100 * outcome.agreement_before:.1f}% -> "
            f"{100 * outcome.agreement_after:.1f}%, guesses kept in rounds of {DEFAULT_DRAFT_TOKENS} "
            f"{100 * outcome.kept_before:.1f}% -> {100 * outcome.kept_after:.1f}%, on {outcome.held_out_tokens} "
            f"tokens of the latest {outcome.held_out['requests']} requests; trained {outcome.steps} steps in "
            f"{outcome.train_s:.0f} s")
    return 0


def cmd_traffic(args: argparse.Namespace) -> int:
    from draftwise.files import prepare_out
    from draftwise.train.traffic import traffic, write_traffic

    if args.requests < 2:
        raise DraftwiseError(f"--requests must be >= 2 (one to learn from, one held out), got {args.requests}")
    out = prepare_out(args.out, "train.jsonl and eval.jsonl")
    parts = traffic(args.requests, args.held_out, args.seed, service=args.service)
    for part, path in write_traffic(out, parts).items():
        packages = sorted({record["package"] for record in parts[part]})
        print(f"{path}: {len(parts[part])} requests from {len(packages)} packages "
              f"({', '.join(packages[:6])}{', ...' if len(packages) > 6 else ''})")
    return 0


def _remove(work: Path) -> None:
    import shutil

    shutil.rmtree(work, ignore_errors=True)  # its checkpoint served its run
