"""A sequence's life on an engine: checked, opened (its slot of the target, its proposer, its starting estimates),
prefilled, closed (what it learnt pooled, its caches offered, its slots given back).

The target's default slot and the engine's own proposer serve the first live sequence, so a single stream needs no
slot of its own; every other live sequence gets its own slot of the target and its own proposer (a fork).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from draftwise.acceptance_pools import AcceptancePools, pool_method
from draftwise.catch_up import CatchUp
from draftwise.config import GenerationConfig, SamplingConfig
from draftwise.draft_lengths import DraftLengths
from draftwise.draft_registry import DraftRegistry
from draftwise.errors import DraftwiseError
from draftwise.estimates import Acceptance
from draftwise.grammar import GrammarCompiler
from draftwise.methods import Parts, available_methods, check_method, new_proposer
from draftwise.metrics import Stats
from draftwise.proposers.base import Proposer
from draftwise.round import RoundHooks, reads_features
from draftwise.sampling import make_generator
from draftwise.shared_noise import SharedNoise
from draftwise.sequence import Sequence
from draftwise.text import TextStream
from draftwise.text_caches import TextCaches
from draftwise.tokenizers import CROSS_TOKENIZER

TEXT_CONTEXT = 5  # the prompt's last ids, decoded ahead of the text (TextStream: a continuation's leading space)
GREEDY = SamplingConfig()  # what a proposer is begun with where its sequence draws from shared noise


@dataclass
class Sequences:
    target: object  # the shared target backend
    tokenizer: object
    proposer: Proposer | None  # the engine's own
    method: str  # the engine's own
    max_context: int
    readable_ids: int  # the ids a prompt of token ids may hold
    grammars: GrammarCompiler
    speed_paths: dict
    drafts: DraftRegistry
    caches: TextCaches
    pools: AcceptancePools
    lengths: DraftLengths
    catch_up: CatchUp
    hooks: RoundHooks
    _default_in_use: bool = False

    @property
    def methods_available(self) -> tuple[str, ...]:
        """The methods a sequence may ask for: the target alone and lookup always, the draft model's with a
        draft, the head's with a head, skip and hybrid-skip on an engine built for either (the skip draft's plan is
        calibrated at load); a draft with another tokenizer than the target's drafts no trees."""
        return available_methods(self.method, self.target.backend_name,
                                 draft_chains_only=self.speed_paths.get("draft_tokenizer") == CROSS_TOKENIZER)

    def check_open(self, prompt_ids: list[int], cfg: GenerationConfig) -> str:
        """The method a sequence of these options would run, once its method and limits are checked."""
        method = cfg.method or self.method
        check_method(method)
        if method not in self.methods_available:
            raise DraftwiseError(f"method {method!r} is not available here; choose one of: "
                                 f"{', '.join(self.methods_available)}")
        self.check_limits(len(prompt_ids), cfg)
        if any(not 0 <= t < self.readable_ids for t in prompt_ids):
            raise DraftwiseError(f"token ids in the prompt must be in [0, {self.readable_ids}): the ids the "
                                 "tokenizer and the target's embedding share")
        if cfg.grammar is not None:
            self.grammars.check(cfg.grammar)
        self.drafts.check(cfg, method, self.methods_available)
        return method

    def check_limits(self, prompt_len: int, cfg: GenerationConfig) -> None:
        """Raise DraftwiseError when the request cannot fit the context (before anything is allocated)."""
        context = self.max_context
        if prompt_len < 1:
            raise DraftwiseError("the prompt is empty; give at least one token")
        if prompt_len + cfg.max_new_tokens > context:
            room = context - prompt_len
            allowed = f"at most {room} new tokens fit" if room > 0 else "shorten the prompt"
            raise DraftwiseError(
                f"the prompt ({prompt_len} tokens) plus max_new_tokens ({cfg.max_new_tokens}) exceeds the "
                f"model context of {context} tokens; {allowed}"
            )

    def open(self, prompt_ids: list[int], cfg: GenerationConfig) -> Sequence:
        """A live sequence with its own cache slots and proposer; checked before anything is allocated."""
        cfg = self.drafts.settle(cfg)
        method = self.check_open(prompt_ids, cfg)
        cfg = self.drafts.with_front(cfg, method)
        constraint = None if cfg.grammar is None else self.grammars.constraint(cfg.grammar)
        # A seeded sampled request draws its tokens from noise its seed decides (shared_noise.py): its text is the
        # same whatever the rounds' shapes, so its k may follow the timings as a greedy one's does.
        seeded = not cfg.sampling.greedy and cfg.sampling.seed is not None
        noise = SharedNoise(cfg.sampling, self.target.vocab_size) if seeded else None
        target, proposer, generator, reused = self._allocate(prompt_ids, cfg, method, constraint, noise)
        acceptance = Acceptance() if proposer and cfg.adaptive else None
        policy = self.lengths.policy_for(pool_method(method, cfg.draft))
        if acceptance is not None:
            policy.sequence_joined()
        if proposer is not None:  # a tree's width, lookup's depth, a hybrid's pick: by what steps cost here
            proposer.price_with(policy.costs, follow=acceptance is not None)  # (not for a fixed k)
        stats = Stats(method=method, num_draft_tokens=cfg.num_draft_tokens, prompt_tokens=len(prompt_ids),
                      speed_paths=self.speed_paths, prompt_cached=reused)
        seq = Sequence(prompt_ids=list(prompt_ids), cfg=cfg, method=method, target=target, proposer=proposer,
                       acceptance=acceptance, text=TextStream(self.tokenizer, cfg.stop, prompt_ids[-TEXT_CONTEXT:]),
                       stats=stats, generator=generator, context=list(prompt_ids), prefilled=reused,
                       constraint=constraint, noise=noise)
        if acceptance is not None:
            self.pools.start(seq)
        self.catch_up.open_sequences += 1
        return seq

    def _allocate(self, prompt_ids: list[int], cfg: GenerationConfig, method: str, constraint,
                  noise: SharedNoise | None):
        """The sequence's slot of the target and its proposer, begun on the prompt and given what the prompt cache
        holds of it; nothing allocated here outlives a failure. Returns (target, proposer, generator, reused). With
        shared noise the proposer guesses as for greedy decoding, or runs the noise's race itself (share_noise)."""
        if not self._default_in_use and method == self.method and cfg.draft is None:
            self._default_in_use = True
            target, proposer = self.target.default, self.proposer
        else:
            target, proposer = self.target.open_slot(), None
        try:
            if target is not self.target.default:
                proposer = self._new_proposer(method, cfg.draft)
            generator = make_generator(cfg.sampling.seed)
            target.trim(0)
            if proposer is not None:
                proposer.bind(target)  # (a proposer that drafts in the sequence's own target slot)
                proposer.begin(prompt_ids, GREEDY if noise is not None else cfg.sampling, generator)
                proposer.share_noise(noise)
                proposer.follow_grammar(None if constraint is None else constraint.guide())
            reused = self.caches.restore(target, proposer, prompt_ids)
        except BaseException:
            self._release(target, proposer)
            raise
        return target, proposer, generator, reused

    def _new_proposer(self, method: str, draft: str | None = None) -> Proposer | None:
        """A proposer for a sequence that does not get the engine's own: a fork of it, or one of another method
        that the engine's models serve, made by the method's entry in methods.py from parts the engine's proposer
        forks: a new slot of its draft model (or of the draft named), or its head or skip draft (a hybrid's too)."""
        own = self.proposer
        if own is not None and method == self.method and draft is None:
            return own.fork()
        on_draft = self.drafts.drafts[draft] if draft is not None else None if own is None else own.fork_on_draft_model
        parts = Parts(on_draft_model=on_draft, drafter=None if own is None else own.fork_drafter,
                      corpus=self.caches.proposals)
        return new_proposer(method, parts)

    def prefill(self, seq: Sequence, max_tokens: int | None = None) -> None:
        """Put (up to max_tokens more of) the prompt, all but its last token, into the target's cache; once it is
        there, into the draft's, for a sequence that drafts a fixed k (see Sequence.prefill_done)."""
        started = time.perf_counter()
        done = seq.prefilled
        end = len(seq.prompt_ids) - 1 if max_tokens is None else min(len(seq.prompt_ids) - 1, done + max_tokens)
        if end > done:
            reads, sink = reads_features(seq.proposer), self.hooks.feature_sink
            features = seq.target.append(seq.prompt_ids[done:end], hidden=reads or sink is not None)
            if features is not None and reads:
                seq.proposer.add_features(done, features)
            if features is not None and sink is not None:
                sink(seq, done, features)
            seq.prefilled = end
        elif seq.acceptance is None:
            self.catch_up.fill(seq, max_tokens)
        seq.stats.prefill_s += time.perf_counter() - started

    def close(self, seq: Sequence) -> None:
        """Give the sequence's slots back (once); the engine's own slot and proposer become free for the next."""
        if seq.target is None:
            return
        try:
            self.pools.carry(seq)
            self.catch_up.count_answer(seq)
            self.caches.remember(seq)
        finally:  # the caches are offered what they may keep; the slots go back whatever happened there
            self._release(seq.target, seq.proposer)
            seq.target = None
            self.catch_up.open_sequences -= 1

    def _release(self, target, proposer) -> None:
        if target is self.target.default:
            self._default_in_use = False
        else:
            target.close()
            if proposer is not None:
                proposer.release()
