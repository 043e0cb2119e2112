"""`draftwise train-head`: train a feature head for a target on this machine (argparse stays in the CLI layer)."""
from __future__ import annotations

import argparse
import json
import math
import sys

from draftwise import options
from draftwise.errors import DraftwiseError
from draftwise.files import prepare_out
from draftwise.train.head import TrainConfig

DEFAULTS = TrainConfig()


def add_train_head(commands, formatter) -> None:
    p = commands.add_parser(
        "train-head", formatter_class=formatter, help="train a cheap feature-level draft head for a target",
        description=(
            "Train an EAGLE-style head for --method head: one decoder layer that reads the target's own last\n"
            "hidden state and the next token, and predicts the next hidden state, read out by the target's output\n"
            "layer. First the target answers requests built from the training corpus (source and docs of the\n"
            "third-party packages installed beside draftwise; never the benchmark prompts or the standard\n"
            "library) and everyday requests, then it runs over its answers and the corpus, and its features are\n"
            "kept under OUT/features; then the head trains, with a progress bar, a checkpoint\n"
            "every few steps (run the same command again to resume) and the top-1 and top-3 accuracy of a\n"
            "held-back twentieth of the sequences before and after each epoch."),
        epilog="--method head then finds the head in the default folder, or takes --head DIR.")
    options.add_target(p, role="the model the head drafts for")
    p.add_argument("--out", metavar="DIR",
                   help="where to write the head (default: $DRAFTWISE_HOME/heads/<target name>)")
    options.add_dtype(p, role="the dtype the target runs in while its features are collected; use the one you will "
                              "generate with")
    options.add_device(p, what="the target runs and the head trains")
    p.add_argument("--max-tokens", type=int, default=DEFAULTS.max_tokens, metavar="N",
                   help="corpus size in target tokens (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=DEFAULTS.seq_len, metavar="N",
                   help="tokens per training sequence (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=DEFAULTS.epochs, metavar="N", help="(default: %(default)s)")
    p.add_argument("--lr", type=float, default=DEFAULTS.lr, metavar="LR", help="peak learning rate (default: %(default)s)")
    p.add_argument("--intermediate-size", type=int, default=DEFAULTS.intermediate_size, metavar="N",
                   help="the head's MLP width; it sets the head's cost per token (default: %(default)s)")
    p.add_argument("--readout", type=int, default=DEFAULTS.readout, metavar="N",
                   help="target tokens the head can propose: the N the target emits most on the training split, then "
                        "the lowest ids; the readout is most of a head forward's cost (default: %(default)s)")
    p.add_argument("--answers", type=int, default=DEFAULTS.answers, metavar="N",
                   help="also train on the target's own greedy answers to N requests built from the corpus (explain, "
                        "summarize, translate ...): slower to make, closer to what the head drafts for (default: "
                        "%(default)s)")
    p.add_argument("--everyday", type=int, default=DEFAULTS.everyday, metavar="N",
                   help="also train on the target's own answers to N everyday requests (news and their summaries, "
                        "translation into English, questions, advice, worked arithmetic, on a list of everyday "
                        "topics): the package corpus is code and technical prose, and users ask for more "
                        "(default: %(default)s)")
    p.add_argument("--answer-tokens", type=int, default=DEFAULTS.answer_tokens, metavar="N",
                   help="the longest answer (default: %(default)s)")
    p.add_argument("--feature-layers", metavar="L,L", default="",
                   help="decoder layers (0: the first) whose outputs the head also reads, fused with the last hidden "
                        "state as EAGLE-3 does, e.g. 2,14 (default: none, the last hidden state alone)")
    p.add_argument("--read-current", action=argparse.BooleanOptionalAction, default=DEFAULTS.reads_current,
                   help="give each head input the embedding of the token its feature was computed at, beside the "
                        "next one's, so that its attention can copy from earlier text (default: %(default)s)")
    p.add_argument("--captured", metavar="DIR",
                   help="train on the requests a server captured (`draftwise serve --capture-features DIR`) instead "
                        "of the corpus: their features are the target's own as it served them, so no target pass "
                        "runs here; the latest fifth is held out for validation")
    p.add_argument("--json", action="store_true", help="print the training record as one JSON object")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_train_head)


def feature_layers(text: str) -> tuple[int, ...]:
    """'2,14' -> (2, 14), ascending, each once; '' -> ()."""
    try:
        layers = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise DraftwiseError(f"--feature-layers takes decoder layer numbers separated by commas, e.g. 2,14; "
                             f"got {text!r}") from None
    if any(layer < 0 for layer in layers):
        raise DraftwiseError(f"--feature-layers numbers the decoder layers from 0; got {text!r}")
    return tuple(sorted(layers))


def _captured(folder: str) -> list:
    """The --captured folder's files, earliest first, or an error that says why there are none."""
    from pathlib import Path

    from draftwise.serve.feature_capture import captured_files

    if not Path(folder).is_dir():
        raise DraftwiseError(f"--captured {folder}: no such folder (a server writes it with --capture-features)")
    files = captured_files(folder)
    if len(files) < 2:
        raise DraftwiseError(f"--captured {folder}: {len(files)} captured request(s); training holds the latest "
                             "fifth out, so it needs at least 2 (serve longer with --capture-features)")
    return files


def cmd_train_head(args: argparse.Namespace) -> int:
    from draftwise.loading import load_models
    from draftwise.models.store import head_home
    from draftwise.train.head import train_head

    for name in ("answers", "everyday"):
        if getattr(args, name) < 0:
            raise DraftwiseError(f"--{name} must be >= 0, got {getattr(args, name)}")
    for name in ("max_tokens", "seq_len", "epochs", "intermediate_size", "readout", "answer_tokens"):
        if getattr(args, name) < 1:
            raise DraftwiseError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seq_len < 8:
        raise DraftwiseError(f"--seq-len must be >= 8 (a sequence teaches its positions past the second), got {args.seq_len}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise DraftwiseError(f"--lr must be a number > 0, got {args.lr}")
    captured = _captured(args.captured) if args.captured else None
    out = prepare_out(args.out or head_home(args.target), "the head")  # now, not after the target loads
    cfg = TrainConfig(max_tokens=args.max_tokens, seq_len=args.seq_len, epochs=args.epochs, lr=args.lr,
                      intermediate_size=args.intermediate_size, readout=args.readout, answers=args.answers,
                      everyday=args.everyday,
                      answer_tokens=args.answer_tokens, feature_layers=feature_layers(args.feature_layers),
                      reads_current=args.read_current)
    progress = not args.quiet
    target_model, tokenizer, *_ = load_models(args.target, None, args.dtype, args.device, progress=progress)
    log = (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        record = train_head(target_model, tokenizer, out, cfg, progress=progress, target_name=args.target, log=log,
                            captured=captured)
    except ValueError as err:
        raise DraftwiseError(str(err)) from err
    if args.json:
        print(json.dumps({"out": str(out), **record}))
    else:
        after = record["val_after"][-1]
        print(out)
        log(f"trained on {record['train_tokens']} tokens in {record['train_s']:.0f} s (features: "
            f"{record['collect_s']:.0f} s); validation top-1 {100 * after['top1']:.1f}%, top-3 {100 * after['top3']:.1f}%"
            + (f"; as the engine runs it {100 * record['val_as_run']['top1']:.1f}%" if "val_as_run" in record else ""))
    return 0
