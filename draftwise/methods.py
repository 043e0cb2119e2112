"""The speculation methods, each declared once: its name, what it needs beside the target, one line of help, and
how its proposer is made.

The CLI's --method choices, bench's methods, the server's validation and Engine.methods_available all read
METHODS. A new method is one entry here plus its proposer module.

What a method needs decides what an engine loads once (loading.assemble) and which methods one engine can serve
to a sequence that asks: those that need nothing, and those that need what the engine's own method needs (the
same draft model, trained head or calibrated layers).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from draftwise.backends.capabilities import BackendCapabilities
from draftwise.backends.registry import BACKEND_CLASSES
from draftwise.config import DEFAULT_LOOKUP_NGRAM
from draftwise.errors import DraftwiseError
from draftwise.proposers.base import Proposer
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.draft_tree import DraftTreeProposer
from draftwise.proposers.hybrid import hybrid_of
from draftwise.proposers.prompt_lookup import PromptLookupProposer
from draftwise.proposers.proposal_cache import ProposalCache

# What a method needs beside the target (None: nothing, it runs on the target and the text alone).
DRAFT_MODEL = "a draft model"  # a second, smaller model (--draft): its own tokenizer or the target's
TRAINED_HEAD = "a trained head"  # a feature head trained for this target (draftwise train-head)
OWN_LAYERS = "the target's own layers"  # some of the target's layers, picked by a calibration at load
NEEDS = (DRAFT_MODEL, TRAINED_HEAD, OWN_LAYERS)

# What a method may ask of the target's backend beyond scoring chains of tokens, and what each backend serves: a
# method runs only on a backend that serves all it asks (the llama.cpp route scores chains alone).
TREES = "token trees"  # a tree scored in one pass, its kept path moved into place
INTERNALS = "the model's internals"  # hidden states (a feature head) or some of its layers alone (layer skipping)
# Each ask, as the capabilities a backend must declare for it (backends/capabilities.py).
ASKS: dict[str, tuple[str, ...]] = {TREES: ("trees",), INTERNALS: ("hidden_states", "layer_access")}


def served(capabilities: BackendCapabilities) -> frozenset[str]:
    """The asks that a backend declaring capabilities serves."""
    return frozenset(ask for ask, fields in ASKS.items() if all(getattr(capabilities, name) for name in fields))


# By --backend name, from what each class declares: hf: transformers, weights in --dtype; quant: the same model with
# its linears on the GGUF file's own blocks (backends/qgemm.c); llamacpp: the GGUF file through llama.cpp.
BACKENDS: dict[str, frozenset[str]] = {name: served(cls.capabilities) for name, cls in BACKEND_CLASSES.items()}
DEFAULT_BACKEND = "hf"
AUTO_BACKEND = "auto"  # quant where it runs and the GGUF files are here, else hf (loading.auto_backend)

BASELINE = "none"  # the target alone: what every method's speed is compared with, and first in every list
# Prompt lookup's branches: the continuations of how many earlier matches one guess merges (more than one: a tree).
LOOKUP_CHAIN, LOOKUP_TREE = 1, 3


@dataclass(frozen=True)
class Parts:
    """What a method's proposer is made from on one engine.

    on_draft_model(cls): a proposer of class cls on (a slot of) the engine's draft model; None without one.
    drafter(): the engine's trained-head or layer-skipping drafter, a fresh one; None without one.
    The lookup fields configure prompt lookup, alone or in a hybrid (corpus: earlier requests' texts)."""

    on_draft_model: Callable[[type], Proposer] | None = None
    drafter: Callable[[], Proposer] | None = None
    lookup_max_ngram: int = DEFAULT_LOOKUP_NGRAM
    lookup_min_ngram: int | None = None  # None: 1 for lookup alone, the hybrid's own rule in a hybrid
    corpus: ProposalCache | None = None

    def lookup(self, branches: int) -> PromptLookupProposer:
        min_ngram = 1 if self.lookup_min_ngram is None else self.lookup_min_ngram
        return PromptLookupProposer(self.lookup_max_ngram, min_ngram, self.corpus, branches)

    def hybrid(self, drafter: Proposer, branches: int):
        return hybrid_of(drafter, branches, self.lookup_max_ngram, self.lookup_min_ngram, self.corpus)


@dataclass(frozen=True)
class Method:
    name: str
    needs: str | None  # one of NEEDS, or None
    help: str  # one line, for --help and the docs
    make: Callable[[Parts], Proposer | None]  # None: no proposer, the target alone
    chain: str | None = None  # a tree method's chain form, which the bench reports it beside
    asks: frozenset[str] = frozenset()  # what it needs of the target's backend (TREES, INTERNALS): see BACKENDS


def _on_draft_model(cls) -> Callable[[Parts], Proposer]:
    return lambda parts: parts.on_draft_model(cls)


def _drafter(parts: Parts) -> Proposer:
    return parts.drafter()


def _lookup(branches: int) -> Callable[[Parts], Proposer]:
    return lambda parts: parts.lookup(branches)


def _hybrid(drafter: Callable[[Parts], Proposer], branches: int) -> Callable[[Parts], Proposer]:
    """Prompt lookup where the text's tail matches earlier text, the drafter elsewhere, picked round by round."""
    return lambda parts: parts.hybrid(drafter(parts), branches)


# In the order errors list them; bench reports BASELINE first, then the rest in this order.
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("draft", DRAFT_MODEL, "the --draft model", _on_draft_model(DraftModelProposer)),
    Method("draft-tree", DRAFT_MODEL, "the --draft model's likeliest continuations as a token tree",
           _on_draft_model(DraftTreeProposer), chain="draft", asks=frozenset({TREES})),
    Method("lookup", None, "n-grams of the prompt and text so far", _lookup(LOOKUP_CHAIN)),
    Method("lookup-tree", None, f"lookup's last {LOOKUP_TREE} matches as a token tree", _lookup(LOOKUP_TREE),
           chain="lookup", asks=frozenset({TREES})),
    Method(BASELINE, None, "the target alone: the baseline", lambda parts: None),
    Method("hybrid", DRAFT_MODEL, "lookup where the text's tail matches earlier text, the --draft model elsewhere",
           _hybrid(_on_draft_model(DraftModelProposer), LOOKUP_CHAIN)),
    Method("hybrid-tree", DRAFT_MODEL, "the same with lookup-tree and draft-tree",
           _hybrid(_on_draft_model(DraftTreeProposer), LOOKUP_TREE), chain="hybrid", asks=frozenset({TREES})),
    Method("skip", OWN_LAYERS, "the target itself on int8 copies of its layers where faster here, with some layers "
           "skipped where a short calibration at load says it pays; no second model", _drafter,
           asks=frozenset({INTERNALS})),
    Method("hybrid-skip", OWN_LAYERS, "skip, and lookup where the text's tail matches earlier text; no second model",
           _hybrid(_drafter, LOOKUP_CHAIN), asks=frozenset({INTERNALS})),
    Method("head", TRAINED_HEAD, "a trained feature head, see train-head, drafting token trees", _drafter,
           asks=frozenset({TREES, INTERNALS})),
    Method("hybrid-head", TRAINED_HEAD, "the head, and lookup-tree where the text's tail matches earlier text; no "
           "second model", _hybrid(_drafter, LOOKUP_TREE), asks=frozenset({TREES, INTERNALS})),
)}


def register(method: Method) -> None:
    """Add a method to the table (a plug-in's, or a test's); its name must be new."""
    if method.name in METHODS:
        raise DraftwiseError(f"method {method.name!r} is already in the table")
    if method.needs is not None and method.needs not in NEEDS:
        raise DraftwiseError(f"method {method.name!r}: needs must be None or one of {', '.join(NEEDS)}")
    if not method.help.strip():
        raise DraftwiseError(f"method {method.name!r} has no help line")
    METHODS[method.name] = method


def method_names() -> tuple[str, ...]:
    return tuple(METHODS)


def tree_chains() -> dict[str, str]:
    """Each tree method that has a chain form -> that chain method."""
    return {name: method.chain for name, method in METHODS.items() if method.chain is not None}


def methods_needing(need: str | None) -> tuple[str, ...]:
    return tuple(name for name, method in METHODS.items() if method.needs == need)


def needs(method: str | None, need: str) -> bool:
    """Whether method (None: not chosen yet) is one that needs `need`."""
    return method in METHODS and METHODS[method].needs == need


def check_method(method: str) -> Method:
    if method not in METHODS:
        raise DraftwiseError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[method]


def choose_method(method: str | None, has_draft: bool) -> str:
    """method defaults to "draft" when a draft is given, else "lookup"; "none" runs the target alone."""
    method = method or ("draft" if has_draft else "lookup")
    if check_method(method).needs == DRAFT_MODEL and not has_draft:
        raise DraftwiseError(f"method {method!r} needs a draft model (--draft NAME, folder or .gguf path)")
    return method


def available_methods(own: str, backend: str = DEFAULT_BACKEND, draft_chains_only: bool = False
                      ) -> tuple[str, ...]:
    """The methods a sequence may ask for on an engine built for method `own` on `backend`: the target alone and
    those that need nothing, then those that need what own needs (its draft model, head or calibrated layers);
    of those, the ones the backend serves. draft_chains_only: the draft model drafts no trees (a draft with another
    tokenizer than the target's), so the draft model's tree methods are left out."""
    need = METHODS[own].needs
    free = [name for name in methods_needing(None) if name != BASELINE]
    served = BACKENDS[backend]
    return tuple(name for name in (BASELINE, *free, *(methods_needing(need) if need is not None else ()))
                 if METHODS[name].asks <= served
                 and not (draft_chains_only and METHODS[name].needs == DRAFT_MODEL and TREES in METHODS[name].asks))


def check_backend(backend: str, method: str | None = None) -> None:
    """Refuse an unknown backend, or a method that asks what the backend does not serve (naming those that do)."""
    if backend not in BACKENDS:
        raise DraftwiseError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    if method is None:
        return
    missing = check_method(method).asks - BACKENDS[backend]
    if missing:
        serving = [name for name, served in BACKENDS.items() if check_method(method).asks <= served]
        raise DraftwiseError(f"method {method!r} needs {' and '.join(sorted(missing))}, which the {backend} backend "
                             f"does not give; it runs on the {' or '.join(serving)} backend (--backend "
                             f"{serving[0]})")


def new_proposer(method: str, parts: Parts) -> Proposer | None:
    """A fresh proposer for method from an engine's parts; None for the target alone."""
    return check_method(method).make(parts)


def methods_help() -> str:
    """Each method's line, for --method's help."""
    return ", ".join(f"'{name}' ({method.help})" for name, method in METHODS.items())
