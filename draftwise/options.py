"""The command-line options that generate, serve, bench and train-head share, each declared once: its flags, its
help and its default (config.py). A command adds the ones it takes to its own argument groups, naming only what
differs for it (a required --target, several dtypes, what a flag means there); argparse stays in the CLI layer.
"""
from __future__ import annotations

import argparse

from draftwise.config import (DEFAULT_DRAFT_TOKENS, DEFAULT_LOOKUP_NGRAM, DEFAULT_MAX_NEW_TOKENS, DEFAULT_TARGET,
                              DTYPES, MAX_DRAFT_TOKENS, SamplingConfig)
from draftwise.errors import DraftwiseError
from draftwise.methods import (AUTO_BACKEND, BACKENDS, DEFAULT_BACKEND, DRAFT_MODEL, TRAINED_HEAD, available_methods,
                               method_names, methods_help, methods_needing)

MODEL_FORMS = "NAME, Hugging Face folder or .gguf path"
DEFAULT_METHOD_HELP = "draft when --draft is given, else lookup"


def add_target(group, *, required: bool = False, role: str = "the model whose output you get") -> None:
    """--target; required, or DEFAULT_TARGET."""
    if required:
        group.add_argument("--target", required=True, metavar="MODEL", help=f"{role}: {MODEL_FORMS} (required)")
    else:
        group.add_argument("--target", default=DEFAULT_TARGET, metavar="MODEL",
                           help=f"{role}: {MODEL_FORMS} (default: %(default)s)")


def add_draft(group, *, default: str | None = None, also: str = "") -> None:
    """--draft: the draft model of the methods that need one; also: what else the command uses it for."""
    uses = f"for the methods that need one ({', '.join(methods_needing(DRAFT_MODEL))}){also}"
    help_ = (f"a small model, {uses}; one with another tokenizer than the target's drafts through text, chains "
             "only (draft, hybrid)")
    group.add_argument("--draft", default=default, metavar="MODEL",
                       help=help_ if default is None else f"{help_} (default: %(default)s)")


def add_method(group, *, role: str = "who proposes tokens") -> None:
    """--method, one of the table's (methods.py)."""
    group.add_argument("--method", choices=method_names(),
                       help=f"{role}: {methods_help()} (default: {DEFAULT_METHOD_HELP})")


def add_head(group) -> None:
    group.add_argument("--head", metavar="DIR",
                       help=f"the trained head for --method {' or '.join(methods_needing(TRAINED_HEAD))} (default: "
                            "where 'draftwise train-head' puts the target's, $DRAFTWISE_HOME/heads/<target name>)")


def add_dtype(group, *, several: bool = False, role: str = "weights dtype at load time") -> None:
    """--dtype: one of DTYPES, or (several) a comma-separated list of them."""
    what = ("on the hf backend, 'auto' is bfloat16 where the hardware computes it (AVX-512 BF16, AMX, CUDA) and "
            "float32 elsewhere; float32 gives token-for-token identity with the target alone, bfloat16 may differ at "
            "rounding near-ties (the quant backend computes in float32 around its integer kernel, and is exact)")
    if several:
        group.add_argument("--dtype", default="auto", metavar="D,D,...",
                           help=f"{role}, comma-separated, from: {', '.join(DTYPES)}, or gguf (the quant backend: "
                                "the GGUF files' own blocks on draftwise's integer kernel); the whole bench runs once "
                                f"per entry; {what} (default: %(default)s)")
    else:
        group.add_argument("--dtype", choices=DTYPES, default="auto", help=f"{role}: {what} (default: %(default)s)")


def add_backend(group) -> None:
    """--backend: what runs the models (methods.BACKENDS)."""
    chains = ", ".join(available_methods("hybrid", "llamacpp"))
    group.add_argument("--backend", choices=(*BACKENDS, AUTO_BACKEND), default=AUTO_BACKEND,
                       help="what runs the models: 'hf' (transformers, every method), 'quant' (the GGUF file "
                            "itself: its 4- and 6-bit blocks on draftwise's integer kernel, compiled here on first "
                            "use, float32 around it; every method) or "
                            "'llamacpp' (the GGUF file as published, through llama-cpp-python: pip install "
                            f"'draftwise[llamacpp]'; the methods {chains}; --dtype does not apply) or 'auto' (quant "
                            "where this CPU has AVX2 and FMA (AVX-512 not needed), the models their GGUF files, --dtype is left at auto "
                            "and --no-batch-invariant not given; hf otherwise) (default: %(default)s)")


def add_batch_invariant(group) -> None:
    """--batch-invariant/--no-batch-invariant: a row's logits the same bits in any call (loading.resolve_invariance)."""
    group.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                       help="compute every row the same way whatever else its call holds (a plain step, a "
                            "verification pass, a tree, a prefill chunk, a batch), so that every method and every "
                            "batch gives the target's own tokens bit for bit, in bfloat16 too; --no-batch-invariant "
                            "gives that up for kernels timed fastest here (default: on for the cpu, where draftwise "
                            "has the kernels; the quant backend is always)")


def add_device(group, *, what: str = "the models run") -> None:
    group.add_argument("--device", default="cpu", metavar="DEV",
                       help=f"where {what}: cpu, or cuda (cuda:N) on a machine with an NVIDIA GPU and a CUDA build of "
                            "torch (default: %(default)s)")


def add_lookup_ngram(group) -> None:
    group.add_argument("--lookup-ngram", type=int, default=DEFAULT_LOOKUP_NGRAM, metavar="N",
                       help="longest n-gram that prompt lookup matches (the lookup methods, and the hybrids' lookup) "
                            "(default: %(default)s)")


def add_draft_length(group, *, also: str = "") -> None:
    """-k/--num-draft-tokens and --fixed-k; also: what else the command says of them."""
    group.add_argument("-k", "--num-draft-tokens", type=int, default=DEFAULT_DRAFT_TOKENS, metavar="K",
                       help=f"most tokens proposed per round, 1-{MAX_DRAFT_TOKENS}{also} (default: %(default)s)")
    group.add_argument("--fixed-k", action="store_true",
                       help="draft exactly K tokens every round (default: up to K, as many as the measured "
                            "acceptance and costs say pay, none when speculation does not pay)")


def add_max_new_tokens(group, *, role: str = "most tokens to generate") -> None:
    group.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                       help=f"{role} (default: %(default)s)")


def add_sampling(group) -> None:
    """How the target's logits become tokens: greedy unless --temperature is above 0."""
    defaults = SamplingConfig()
    group.add_argument("--temperature", type=float, default=defaults.temperature, metavar="T",
                       help="sampling temperature; 0 is greedy (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=defaults.top_k, metavar="N",
                       help="sample among the N most likely tokens; 0 keeps all (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=defaults.top_p, metavar="P",
                       help="sample among the most likely tokens whose probability sums to P, "
                            "0 < P <= 1 (default: %(default)s)")
    group.add_argument("--seed", type=int, metavar="N",
                       help="seed for sampling, to make a run repeatable (default: random)")


def check_lookup_ngram(args: argparse.Namespace) -> None:
    if args.lookup_ngram < 1:
        raise DraftwiseError(f"--lookup-ngram must be >= 1, got {args.lookup_ngram}")


def engine_options(args: argparse.Namespace) -> dict:
    """Engine.from_pretrained's keyword options from the shared flags (head only when given, backend only when not
    the default)."""
    return dict(dtype=args.dtype, device=args.device, lookup_max_ngram=args.lookup_ngram,
                **({"head": args.head} if args.head else {}),
                **({"batch_invariant": args.batch_invariant} if args.batch_invariant is not None else {}),
                **({"backend": args.backend} if args.backend != DEFAULT_BACKEND else {}))
