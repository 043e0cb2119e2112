"""The speculative loop: stream() yields events, generate() collects them.

One round, in named phases: propose k tokens; verify them with one target pass over
[last token, draft...]; accept the kept prefix plus the target's own next token; commit the
target cache to exactly the accepted text (in `finally`); let the proposer adapt.

Cache rule: the target's cache holds every token of the text except the last one, which is
fed at the head of the next round, so row 0 of a round's logits scores the first draft token.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from draftwise.adaptive import DraftLengthController
from draftwise.backends.base import Backend
from draftwise.config import GenerationConfig, SamplingConfig
from draftwise.errors import DraftwiseError
from draftwise.metrics import Stats
from draftwise.proposers.base import Proposer
from draftwise.sampling import logits_to_probs, make_generator
from draftwise.text import TextStream
from draftwise.tokenizers import encode_prompt
from draftwise.types import Draft, Event, Verdict
from draftwise.verify import verify_greedy, verify_rejection

@dataclass(frozen=True)
class Result:
    text: str
    token_ids: list[int]
    stats: Stats
    finish_reason: str


class Engine:
    def __init__(self, target: Backend, tokenizer, proposer: Proposer | None, method: str, eos: frozenset[int],
                 max_context: int | None = None, speed_paths: dict | None = None):
        """speed_paths: which speed paths were chosen at load (dtype, kernels, draft vocabulary), for the stats."""
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.method = method
        self.eos = eos
        self.max_context = max_context or target.max_context  # the smallest context of the models involved
        self.speed_paths = dict(speed_paths or {})

    @classmethod
    def from_pretrained(cls, target: str, draft: str | None = None, method: str | None = None, **options) -> "Engine":
        """Load by model name, local Hugging Face folder or .gguf path.

        method: "draft" (default when a draft is given), "lookup" (default otherwise) or "none".
        options: dtype ("auto": bfloat16 where the hardware computes it, else float32; "float32"; "bfloat16"),
        device, progress, lookup_max_ngram, lookup_min_ngram.
        """
        from draftwise.loading import build_engine

        return build_engine(cls, target=target, draft=draft, method=method, **options)

    @classmethod
    def from_models(cls, target_model, tokenizer, draft_model=None, method: str | None = None, **options) -> "Engine":
        """Wrap transformers models already in memory (the draft shares the target's tokenizer)."""
        from draftwise.loading import assemble

        return assemble(cls, target_model, tokenizer, method, draft_model, **options)

    def generate(self, prompt: str | list[int] | list[dict], **options) -> Result:
        """Generate to the end and collect. Options as for stream()."""
        pieces: list[str] = []
        token_ids: list[int] = []
        for event in self.stream(prompt, **options):
            pieces.append(event.text)
            if event.token_id is not None:
                token_ids.append(event.token_id)
            if event.finish_reason is not None:
                return Result("".join(pieces), token_ids, event.stats, event.finish_reason)
        raise AssertionError("stream ended without a final event")

    def stream(
        self,
        prompt: str | list[int] | list[dict],
        *,
        chat: bool = False,
        max_new_tokens: int = 128,
        num_draft_tokens: int = 4,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: tuple[str, ...] | list[str] = (),
        ignore_eos: bool = False,
        adaptive: bool = True,
    ) -> Iterator[Event]:
        """Yield one Event per emitted token, then a final Event with the finish reason and stats.

        adaptive: num_draft_tokens is the most per round, and each round drafts the number that the measured
        acceptance and costs say pays best (none when speculation does not pay); False drafts it every round.
        """
        cfg = GenerationConfig.from_options(
            max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos, adaptive=adaptive,
        )
        prompt_ids = encode_prompt(self.tokenizer, prompt, chat)
        self._check_limits(len(prompt_ids), cfg)
        return self._run(prompt_ids, cfg)

    def _check_limits(self, prompt_len: int, cfg: GenerationConfig) -> None:
        context = self.max_context
        if prompt_len + cfg.max_new_tokens > context:
            room = context - prompt_len
            allowed = f"at most {room} new tokens fit" if room > 0 else "shorten the prompt"
            raise DraftwiseError(
                f"the prompt ({prompt_len} tokens) plus max_new_tokens ({cfg.max_new_tokens}) exceeds the "
                f"model context of {context} tokens; {allowed}"
            )

    def _run(self, prompt_ids: list[int], cfg: GenerationConfig) -> Iterator[Event]:
        stats = Stats(method=self.method, num_draft_tokens=cfg.num_draft_tokens, prompt_tokens=len(prompt_ids),
                      speed_paths=self.speed_paths)
        generator = make_generator(cfg.sampling.seed)
        text = TextStream(self.tokenizer, cfg.stop)
        context = list(prompt_ids)

        started = time.perf_counter()
        self.target.prefill(prompt_ids[:-1])
        if self.proposer is not None:
            self.proposer.begin(prompt_ids, cfg.sampling, generator)
        stats.prefill_s = time.perf_counter() - started

        controller = DraftLengthController(cfg.num_draft_tokens) if self.proposer and cfg.adaptive else None
        finish = None
        resumed = time.perf_counter()
        while finish is None:
            remaining = cfg.max_new_tokens - stats.new_tokens
            k = controller.choose() if controller else cfg.num_draft_tokens
            # Drafting past the last token we may emit is wasted work.
            k = min(k, remaining - 1) if self.proposer is not None else 0
            spent = (stats.draft_s, stats.verify_s)
            stop_confidence = controller.stop_confidence() if controller else 0.0
            draft, verdict = self._round(context, k, cfg.sampling, generator, stats, stop_confidence)
            if controller:
                controller.observe(len(draft), verdict.num_accepted, stats.draft_s - spent[0],
                                   stats.verify_s - spent[1])
            new_tokens = [*draft.token_ids[: verdict.num_accepted], verdict.next_token]
            events = []
            for i, token in enumerate(new_tokens):
                context.append(token)
                stats.new_tokens += 1
                piece = text.add(token)
                finish = self._finish_reason(token, text, stats, cfg)
                if finish is not None:
                    piece += text.finish()
                events.append(Event(token_id=token, text=piece, from_draft=i < verdict.num_accepted))
                if finish is not None:
                    break
            # Draft tokens cut off by an end (EOS, stop, length) were never kept.
            stats.observe_draft(len(draft), min(verdict.num_accepted, len(events)))
            # Time spent by the caller between events is not decoding time.
            stats.decode_s += time.perf_counter() - resumed
            yield from events
            resumed = time.perf_counter()
        yield Event(token_id=None, text="", finish_reason=finish, stats=stats)

    def _finish_reason(self, token: int, text: TextStream, stats: Stats, cfg: GenerationConfig) -> str | None:
        if text.stopped:
            return "stop"
        if token in self.eos and not cfg.ignore_eos:
            return "eos"
        if stats.new_tokens >= cfg.max_new_tokens:
            return "length"
        return None

    def _round(
        self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator, stats: Stats,
        stop_confidence: float = 0.0,
    ) -> tuple[Draft, Verdict]:
        # Propose, then verify: one target pass scores the last token's successor and every draft position.
        base = self.target.cache_len  # == len(context) - 1
        draft, verdict = Draft(token_ids=()), None
        started = time.perf_counter()
        try:
            if k > 0:
                draft = self.proposer.propose(context, k, stop_confidence)
            proposed = time.perf_counter()
            stats.draft_s += proposed - started
            logits = self.target.forward([context[-1], *draft.token_ids])  # [n + 1, vocab]
            verdict = self._verify(draft, logits, sampling, generator)
            stats.verify_s += time.perf_counter() - proposed
        finally:
            # Commit: both caches hold exactly the accepted text, even when the round failed.
            kept = verdict.num_accepted if verdict else 0
            self.target.trim(base + 1 + kept if verdict else base)
            if k > 0:
                self.proposer.observe(kept)
        return draft, verdict

    @staticmethod
    def _verify(draft: Draft, logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> Verdict:
        if sampling.greedy:
            return verify_greedy(draft.token_ids, logits)
        p = logits_to_probs(logits, sampling)  # [n + 1, vocab]
        return verify_rejection(draft.token_ids, draft.q, p, generator)

