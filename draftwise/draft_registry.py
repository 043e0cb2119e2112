"""Draft models loaded beside the engine's own (a distilled version on trial), by name, and the one in front.

The output stays the target's whatever the draft, so a draft can join, lead or leave while requests run: sequences
open on one finish with it, and a request that named one that has since left drafts with the one in front.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from draftwise.backends.hf import embedding_rows
from draftwise.config import GenerationConfig
from draftwise.errors import DraftwiseError
from draftwise.methods import DRAFT_MODEL, needs
from draftwise.text_caches import TextCaches
from draftwise.tokenizers import check_draft_reads_every_token


class DraftRegistry:
    def __init__(self):
        self.drafts: dict[str, Callable] = {}  # name -> the draft's on_draft_model, for methods.Parts
        # How the engine makes one (loading.draft_maker; None where no other draft can join: no draft model, or one
        # with another tokenizer).
        self.maker: Callable | None = None
        self.in_front: str | None = None  # the loaded draft that draft-model methods use unless told
        # Drafts removed since they were loaded: a request that named one while it was there (a trial's, queued when
        # the trial ended) drafts with the one in front instead; the text is the same either way.
        self._retired: set[str] = set()

    def add(self, name: str, draft_model, tokenizer, target_rows: int, max_context: int, caches: TextCaches) -> None:
        """Load draft_model (floats, sharing the target's tokenizer) on the same kernels as the engine's own draft.
        The draft is made ready first, and only then named."""
        if self.maker is None:
            raise DraftwiseError("this engine drafts with no draft model of the target's tokenizer, so no other can "
                                 "be loaded beside it (serve a draft-model method with a --draft)")
        check_draft_reads_every_token(tokenizer, target_rows, embedding_rows(draft_model))
        on_draft, backend = self.maker(draft_model, {})
        if backend.max_context < max_context:
            raise DraftwiseError(f"draft {name!r} reads {backend.max_context} positions, fewer than this engine's "
                                 f"{max_context}")
        caches.attach_draft(backend, name)
        self.drafts = {**self.drafts, name: on_draft}  # (replaced whole: a reader sees either)
        self._retired.discard(name)

    def remove(self, name: str) -> None:
        """Sequences open on it go on with it to their end; new ones can no longer name it."""
        if name == self.in_front:
            raise DraftwiseError(f"draft {name!r} is the one in front: promote another first")
        self.drafts = {key: value for key, value in self.drafts.items() if key != name}
        self._retired.add(name)

    def promote(self, name: str | None) -> None:
        """Put a loaded draft in front (None: the engine's own again). Open sequences finish on the draft they
        started with."""
        if name is not None and name not in self.drafts:
            raise DraftwiseError(f"draft {name!r} is not loaded here")
        self.in_front = name

    def settle(self, cfg: GenerationConfig) -> GenerationConfig:
        """A request's options with the draft it will draft with named, as far as its config says: a retired one
        dropped. (The one in front is filled in once the method is known: with_front.)"""
        return replace(cfg, draft=None) if cfg.draft in self._retired else cfg

    def with_front(self, cfg: GenerationConfig, method: str) -> GenerationConfig:
        """The sequence's record of the draft it drafts with: the one in front, for a draft-model method unless told."""
        if cfg.draft is None and self.in_front is not None and needs(method, DRAFT_MODEL):
            return replace(cfg, draft=self.in_front)
        return cfg

    def check(self, cfg: GenerationConfig, method: str, methods_available: tuple[str, ...]) -> None:
        """A named draft must be loaded here and asked for by a method that drafts with a draft model."""
        if cfg.draft is None:
            return
        if not needs(method, DRAFT_MODEL):
            raise DraftwiseError(f"method {method!r} drafts with no draft model; a draft is named for "
                                 f"{', '.join(m for m in methods_available if needs(m, DRAFT_MODEL))}")
        if cfg.draft not in self.drafts:
            raise DraftwiseError(f"draft {cfg.draft!r} is not loaded here; loaded beside the engine's own: "
                                 f"{', '.join(self.drafts) or 'none'}")
