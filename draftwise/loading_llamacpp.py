"""Assemble an Engine on llama.cpp: the GGUF files as published for the target (and the draft), transformers'
tokenizer as on the transformers route, so the text path is the same."""
from __future__ import annotations

import json

from draftwise.backends.hf import load_tokenizer
from draftwise.backends.llamacpp import LlamaCppBackend
from draftwise.backends.llamacpp_api import LlamaSettings
from draftwise.config import DEFAULT_LOOKUP_NGRAM
from draftwise.errors import DraftwiseError
from draftwise.methods import DRAFT_MODEL, METHODS, Parts, new_proposer
from draftwise.proposers.cross_vocab import VocabBridge, on_cross_draft
from draftwise.tokenizers import CROSS_TOKENIZER, check_draft_reads_every_token, draft_path, eos_ids, readable_ids


BACKEND = "the llama.cpp backend"  # as messages name it


def build_llamacpp_engine(engine_cls, *, target: str, draft: str | None, method: str, progress: bool = True,
                          lookup_max_ngram: int = DEFAULT_LOOKUP_NGRAM, lookup_min_ngram: int | None = None,
                          slots: int | None = None, **ignored):
    """method: already chosen and checked against the backend (loading.build_engine). slots: sequences each model
    holds at once (llamacpp.DEFAULT_SLOTS by default). Options of the transformers route (dtype, kernels) that
    mean nothing here are ignored."""
    from draftwise.models import check_resolves, resolve

    for name in (target, draft):
        if name is not None:
            check_resolves(name)
    target_source = resolve(target, progress=progress)
    target_file = target_source.published_gguf(target, BACKEND)
    tokenizer = load_tokenizer(str(target_source.path), target_source.gguf_file)
    draft_file = draft_tokenizer = None
    if draft is not None and METHODS[method].needs == DRAFT_MODEL:
        draft_source = resolve(draft, progress=progress)
        if draft_source.adapter is not None:
            raise DraftwiseError(f"the llama.cpp backend reads a draft's GGUF file as published; {draft} is a draft "
                                 f"version (an adapter on its floats): run it on --backend quant or hf")
        draft_file = draft_source.published_gguf(draft, BACKEND)
        draft_tokenizer = load_tokenizer(str(draft_source.path), draft_source.gguf_file)
    options = {} if slots is None else {"slots": slots}
    settings = LlamaSettings()
    backend = LlamaCppBackend(str(target_file), settings=settings, **options)
    check_vocabulary(backend, tokenizer, target_source, target)
    eos = eos_ids(tokenizer, *_configs(target_source))
    paths = {"backend": "llamacpp", "target_gguf": target_file.name, "threads": settings.thread_count()}
    parts = Parts(lookup_max_ngram=lookup_max_ngram, lookup_min_ngram=lookup_min_ngram)
    max_context = backend.max_context
    if draft_file is not None:
        # A draft's rounding changes only its guesses, never the text: its one-token steps may take the cheaper
        # single-row kernels.
        draft_backend = LlamaCppBackend(str(draft_file), min_width=1, **options)
        pair = paths["draft_tokenizer"] = draft_path(tokenizer, draft_tokenizer)
        paths["draft_gguf"] = draft_file.name
        max_context = min(max_context, draft_backend.max_context)
        if pair == CROSS_TOKENIZER:  # its guesses reach the target as text (proposers/cross_vocab.py)
            bridge = VocabBridge.of(tokenizer, backend.vocab_size, eos, draft_tokenizer, draft_backend.vocab_size,
                                    eos_ids(draft_tokenizer, *_configs(draft_source)))
            on_draft_model = lambda cls: on_cross_draft(cls, draft_backend, bridge)  # noqa: E731
        else:
            check_draft_reads_every_token(tokenizer, backend.embedding_rows, draft_backend.embedding_rows)
            on_draft_model = lambda cls: cls(draft_backend, target_vocab_size=backend.vocab_size)  # noqa: E731
        parts = Parts(lookup_max_ngram=lookup_max_ngram, lookup_min_ngram=lookup_min_ngram,
                      on_draft_model=on_draft_model)
    proposer = new_proposer(method, parts)
    return engine_cls(backend, tokenizer, proposer, method, eos, max_context, speed_paths=paths)


def check_vocabulary(backend: LlamaCppBackend, tokenizer, source, name: str) -> None:
    """llama.cpp's logits must cover every id the tokenizer gives, and as many rows as the converted model's own
    (a store folder's config.json) where there is one: else ids would mean other tokens on the two routes."""
    if readable_ids(tokenizer, backend.vocab_size) < len(tokenizer):
        raise DraftwiseError(f"{name}: llama.cpp reads {backend.vocab_size} token ids but the tokenizer has "
                             f"{len(tokenizer)}")
    config = source.path / "config.json"
    if source.gguf_file is None and config.is_file():
        expected = json.loads(config.read_text()).get("vocab_size")
        if expected is not None and expected != backend.vocab_size:
            raise DraftwiseError(f"{name}: llama.cpp reads {backend.vocab_size} token ids, the converted model "
                                 f"{expected}; pull it again (`draftwise models pull {name} --force`)")


def _configs(source) -> list:
    """The model's config and generation config, for the ids that end a sequence (as the transformers route reads
    them from the loaded model)."""
    from transformers import AutoConfig, GenerationConfig

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    configs = [AutoConfig.from_pretrained(str(source.path), **kwargs)]
    try:
        configs.append(GenerationConfig.from_pretrained(str(source.path), **kwargs))
    except (OSError, ValueError):  # (a .gguf alone has none: the model config's ids stand)
        pass
    return configs
