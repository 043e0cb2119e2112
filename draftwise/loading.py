"""Assemble an Engine: resolve names, load models, check the pair, pick the proposer."""
from __future__ import annotations

from draftwise.backends.hf import HFBackend, load_model, load_tokenizer
from draftwise.config import METHODS
from draftwise.errors import DraftwiseError
from draftwise.proposers import DraftModelProposer, PromptLookupProposer
from draftwise.proposers.compact import KEEP_VOCAB
from draftwise.proposers.compact import compact_draft as compact
from draftwise.tokenizers import check_same_tokenizer, eos_ids


def choose_method(method: str | None, has_draft: bool) -> str:
    """method defaults to "draft" when a draft is given, else "lookup"; "none" runs the target alone."""
    method = method or ("draft" if has_draft else "lookup")
    if method not in METHODS:
        raise DraftwiseError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    if method == "draft" and not has_draft:
        raise DraftwiseError("method 'draft' needs a draft model (--draft NAME, folder or .gguf path)")
    return method


def build_engine(engine_cls, *, target: str, draft: str | None = None, method: str | None = None,
                 dtype: str = "float32", device: str = "cpu", progress: bool = True, **lookup):
    """Load by model name, local Hugging Face folder or .gguf path (pulling a known name if needed)."""
    method = choose_method(method, draft is not None)
    target_model, tokenizer, draft_model = load_models(target, draft if method == "draft" else None, dtype, device,
                                                       progress)
    return assemble(engine_cls, target_model, tokenizer, method, draft_model, **lookup)


def load_models(target: str, draft: str | None = None, dtype: str = "float32", device: str = "cpu",
                progress: bool = True):
    """(target model, tokenizer, draft model or None) by name, folder or .gguf path; the pair checked first."""
    from draftwise.models import resolve  # the store pulls weights; only named models need it

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
             draft_tokenizer=None, lookup_max_ngram: int = 3, lookup_min_ngram: int = 1, compact_draft: bool = True,
             draft_vocab: int = KEEP_VOCAB):
    """Models already in memory -> Engine. The draft must share the target's tokenizer: pass the draft's
    own tokenizer as draft_tokenizer to have that checked.

    compact_draft: propose with a cheaper copy of the draft (int8 weights, an output layer over the
    draft_vocab most common tokens; see proposers/compact.py). Exactness does not depend on it."""
    method = choose_method(method, draft_model is not None)
    target = HFBackend(target_model)
    eos = eos_ids(tokenizer, target_model.generation_config, target_model.config)
    max_context = target.max_context
    if method == "draft":
        if draft_tokenizer is not None:
            check_same_tokenizer(tokenizer, draft_tokenizer)
        token_ids = None
        if compact_draft:
            draft_model, token_ids = compact(draft_model, [*tokenizer.all_special_ids, *eos], draft_vocab)
        draft = HFBackend(draft_model)
        max_context = min(max_context, draft.max_context)
        proposer = DraftModelProposer(draft, target_vocab_size=target.vocab_size, token_ids=token_ids)
    elif method == "lookup":
        proposer = PromptLookupProposer(max_ngram=lookup_max_ngram, min_ngram=lookup_min_ngram)
    else:
        proposer = None
    return engine_cls(target, tokenizer, proposer, method, eos, max_context)
