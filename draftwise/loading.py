"""Assemble an Engine: resolve names, load models, check the pair, pick the proposer."""
from __future__ import annotations

from torch import nn

from draftwise.backends.hf import HFBackend, load_model, load_tokenizer
from draftwise.backends.kernels import DRAFT_KERNELS, EXACT_KERNELS, kernel_counts, on_timed_kernels
from draftwise.config import (DRAFT_METHODS as NEEDS_DRAFT, HEAD_METHODS, HYBRID_PARTS, LOOKUP_BRANCHES, METHODS,
                              SKIP_METHODS)
from draftwise.errors import DraftwiseError
from draftwise.hardware import check_device
from draftwise.proposers import DraftModelProposer, PromptLookupProposer
from draftwise.proposers.compact import KEEP_VOCAB
from draftwise.proposers.compact import compact_draft as compact
from draftwise.proposers.head_model import check_fits, load_head, parameter_count, readout_layer, require_head
from draftwise.proposers.draft_tree import DraftTreeProposer
from draftwise.proposers.feature_head import HeadProposer, attention_window
from draftwise.proposers.hybrid import hybrid_of
from draftwise.proposers.layer_skip import DraftStack, LayerSkipProposer, SkippingBackend, cheaper_stack
from draftwise.proposers.skip_calibration import calibration_ids, plan_skip
from draftwise.tokenizers import check_draft_reads_every_token, check_same_tokenizer, eos_ids


HEAD_WIDTHS = (1, 4)  # a head forward: one new position, or one depth of a tree
# The head's linears whose input joins tensors of different scales: the fuse (the next token's embedding beside the
# target's feature) and a fused head's reduce (several layers' features). int8-dynamic quantizes a call's whole
# input with one scale, which the feature's few huge dimensions set, and rounds the embedding away: the head loses
# the token it conditions on. On the Zen 5 (bfloat16, the default head) the fuse alone on int8-dynamic took the
# held-back top-1 from 42.8% to 33.7% (depth 2: 31.5% to 17.2%); every other linear on int8 left it unchanged.
EXACT_INPUT_LAYERS = ("fuse", "reduce")


def choose_method(method: str | None, has_draft: bool) -> str:
    """method defaults to "draft" when a draft is given, else "lookup"; "none" runs the target alone."""
    method = method or ("draft" if has_draft else "lookup")
    if method not in METHODS:
        raise DraftwiseError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    if method in NEEDS_DRAFT and not has_draft:
        raise DraftwiseError(f"method {method!r} needs a draft model (--draft NAME, folder or .gguf path)")
    return method


def build_engine(engine_cls, *, target: str, draft: str | None = None, method: str | None = None,
                 dtype: str = "auto", device: str = "cpu", progress: bool = True, head: str | None = None, **lookup):
    """Load by model name, local Hugging Face folder or .gguf path (pulling a known name if needed).

    head: the trained head's folder for the methods head and hybrid-head (default: where `draftwise train-head` puts
    the target's)."""
    method = choose_method(method, draft is not None)
    if method in HEAD_METHODS:
        from draftwise.models import head_home

        head = head or str(head_home(target))
        require_head(head)  # an instant, before the target loads for minutes
    target_model, tokenizer, draft_model = load_models(target, draft if method in NEEDS_DRAFT else None, dtype, device,
                                                       progress)
    return assemble(engine_cls, target_model, tokenizer, method, draft_model, head=head, **lookup)


def load_models(target: str, draft: str | None = None, dtype: str = "auto", device: str = "cpu",
                progress: bool = True):
    """(target model, tokenizer, draft model or None) by name, folder or .gguf path; the pair checked first."""
    from draftwise.models import check_resolves, resolve  # the store pulls weights; only named models need it

    check_device(device)  # an instant, before a pull or a load of minutes
    for name in (target, draft):  # a typo in either is refused before the other is pulled (minutes, a GB)
        if name is not None:
            check_resolves(name)

    target_source = resolve(target, progress=progress)
    tokenizer = load_tokenizer(str(target_source.path), target_source.gguf_file)
    draft_model = None
    if draft is not None:
        draft_source = resolve(draft, progress=progress)
        # Tokenizers load in seconds, models in minutes: refuse a mismatched pair before either model.
        check_same_tokenizer(tokenizer, load_tokenizer(str(draft_source.path), draft_source.gguf_file))
        draft_model = load_model(str(draft_source.path), draft_source.gguf_file, dtype, device, progress)
    target_model = load_model(str(target_source.path), target_source.gguf_file, dtype, device, progress)
    return target_model, tokenizer, draft_model


def assemble(engine_cls, target_model, tokenizer, method: str | None = None, draft_model=None,
             draft_tokenizer=None, lookup_max_ngram: int = 3, lookup_min_ngram: int | None = None,
             compact_draft: bool = True, draft_vocab: int = KEEP_VOCAB,
             target_kernels: tuple[str, ...] = EXACT_KERNELS, draft_kernels: tuple[str, ...] = DRAFT_KERNELS,
             head: str | None = None, loaded_model=None):
    """Models already in memory -> Engine. The draft must share the target's tokenizer: pass the draft's
    own tokenizer as draft_tokenizer to have that checked.

    lookup_min_ngram: the shortest match prompt lookup uses; None means 1 for "lookup" and, for the hybrids,
    proposers/hybrid.py's MIN_NGRAM (at most lookup_max_ngram), the match that beats the draft model by rule
    (until the hybrid's pick is measured, and always for a fixed k).

    compact_draft: propose with a cheaper copy of the draft (int8 kernels where faster, an output layer over the
    draft_vocab most common tokens; see proposers/compact.py). Exactness does not depend on it. For skip and
    hybrid-skip, the same cut applies to the layers the draft runs (layer_skip.cheaper_stack); False shares the
    target's own.

    target_kernels: the kernels timed for the target's linears, the fastest here kept (backends/kernels.py:
    same values, a flatter cost per verified token); ("dense",) keeps the model as loaded. The model passed
    in is left as it is. draft_kernels: the same for the compact draft, which may also change values (int8).

    head: for the methods head and hybrid-head, the folder of a head trained for this target (`draftwise train-head`);
    loaded_model: the target as loaded, when target_model was already repacked on kernels (the bench shares one
    such copy among its engines): the head reads out through its output layer's plain weight, and skip's int8
    copies are made from its plain linears."""
    method = choose_method(method, draft_model is not None)
    check_kernels("target", target_kernels, EXACT_KERNELS, " (the target's own values)")
    check_kernels("draft", draft_kernels, DRAFT_KERNELS)
    if method in NEEDS_DRAFT:  # before the kernels are timed or a head is read
        if draft_tokenizer is not None:
            check_same_tokenizer(tokenizer, draft_tokenizer)
        check_draft_reads_every_token(tokenizer, target_model, draft_model)  # also with no draft tokenizer
    if method in HEAD_METHODS and head is None:
        raise DraftwiseError(f"method {method!r} needs the folder of a trained head (head=DIR; see draftwise train-head)")
    # The head reads out through the output layer's weight, which a faster kernel repacks: take it first.
    proposer = head_proposer(loaded_model or target_model, head) if method in HEAD_METHODS else None
    if method == "hybrid-head":
        proposer = hybrid_of(proposer, HYBRID_PARTS[method][1], lookup_max_ngram, lookup_min_ngram)
    loaded = loaded_model or target_model  # plain linears, for the head's readout and skip's copies
    target_model = on_timed_kernels(target_model, target_kernels)
    target = HFBackend(target_model)
    if method in HEAD_METHODS:  # a fused head reads some decoder layers' outputs too
        target.feature_layers = getattr(proposer, "draft", proposer).head.config.feature_layers
    eos = eos_ids(tokenizer, target_model.generation_config, target_model.config)
    max_context = target.max_context
    if method in NEEDS_DRAFT:
        token_ids = None
        if compact_draft:
            draft_model, token_ids, *_ = compact(draft_model, [*tokenizer.all_special_ids, *eos], draft_vocab,
                                                 draft_kernels)
        draft = HFBackend(draft_model)
        max_context = min(max_context, draft.max_context)
        draft_method, lookup_method = HYBRID_PARTS.get(method, (method, None))
        proposer_cls = DraftTreeProposer if draft_method == "draft-tree" else DraftModelProposer
        proposer = proposer_cls(draft, target_vocab_size=target.vocab_size, token_ids=token_ids)
        if lookup_method is not None:
            proposer = hybrid_of(proposer, lookup_method, lookup_max_ngram, lookup_min_ngram)
    elif method in SKIP_METHODS:
        stack = DraftStack()
        if compact_draft:  # the layers it runs on int8 copies where faster here, and a compact output layer
            stack = cheaper_stack(loaded, target_model, [*tokenizer.all_special_ids, *eos], draft_kernels,
                                  draft_vocab)
        plan = plan_skip(target, calibration_ids(tokenizer), stack=stack)
        skipping = SkippingBackend(target, stack.skipping(plan.skip))
        proposer = LayerSkipProposer(skipping, target_vocab_size=target.vocab_size)
        if method == "hybrid-skip":
            proposer = hybrid_of(proposer, HYBRID_PARTS[method][1], lookup_max_ngram, lookup_min_ngram)
    elif method in LOOKUP_BRANCHES:
        min_ngram = 1 if lookup_min_ngram is None else lookup_min_ngram
        proposer = PromptLookupProposer(max_ngram=lookup_max_ngram, min_ngram=min_ngram,
                                        branches=LOOKUP_BRANCHES[method])
    paths = {"dtype": str(target.dtype).removeprefix("torch."), "target_kernels": kernel_counts(target_model)}
    if method in SKIP_METHODS:
        paths["skip_layers"] = list(plan.skip)
        paths["skip_agreement"], paths["skip_cost"] = plan.agreement, plan.cost
        paths["skip_kernels"], paths["skip_vocab"] = skipping.stack.layer_kernels(), skipping.vocab_size
    if method in HEAD_METHODS:
        paths["head"] = getattr(proposer, "draft", proposer).speed_paths  # (a hybrid's head)
    if method in NEEDS_DRAFT:
        paths["draft_kernels"] = kernel_counts(draft_model)
        paths["draft_vocab"] = draft.vocab_size
    return engine_cls(target, tokenizer, proposer, method, eos, max_context, speed_paths=paths)


def check_kernels(model: str, kernels: tuple[str, ...], allowed: tuple[str, ...], why: str = "") -> None:
    """Refuse an empty or unknown choice of kernels for a model, saying which are allowed."""
    if not kernels or set(kernels) - set(allowed):
        raise DraftwiseError(f"{model} kernels must be some of {', '.join(allowed)}{why}; "
                             f"got {', '.join(kernels) or 'none'}")


def head_proposer(target_model, folder: str) -> HeadProposer:
    """The feature head in `folder`, in the target's dtype, reading out through the target's own output layer.

    The head is a draft: its linears (the readout's too) run on the fastest kernel measured here, int8 included,
    as the compact draft's do; only acceptance can move. Except those that read several sources side by side
    (EXACT_INPUT_LAYERS)."""
    head, ids = load_head(folder, dtype=target_model.dtype, device=target_model.device)
    check_fits(head.config, target_model, folder)
    parameters = parameter_count(head)  # (a repacked linear keeps its weight as a buffer)
    exact = {name: on_timed_kernels(nn.Sequential(getattr(head, name)), EXACT_KERNELS, HEAD_WIDTHS)[0]
             for name in EXACT_INPUT_LAYERS if hasattr(head, name)}
    for name in exact:  # out while the rest is timed and repacked: an int8 copy of them would only be thrown away
        setattr(head, name, nn.Identity())
    head = on_timed_kernels(head, DRAFT_KERNELS, HEAD_WIDTHS)
    for name, layer in exact.items():
        setattr(head, name, layer)
    readout = nn.Sequential(readout_layer(target_model, ids))
    readout = on_timed_kernels(readout, DRAFT_KERNELS, HEAD_WIDTHS)[0]
    proposer = HeadProposer(head, readout, ids, target_model.get_input_embeddings(),
                            window=attention_window(head.config))
    proposer.speed_paths = {"folder": str(folder), "parameters": parameters, "readout": len(ids),
                            "kernels": kernel_counts(head)}
    return proposer
