"""The speculative loop, for one sequence or many: open_sequence, prefill, step (one round for every sequence
in the batch, all drafts verified in one target pass), close_sequence. stream() is the batch of one.

One round, in named phases: propose k tokens per sequence (draft-model sequences share each draft forward);
verify every sequence's [last token, draft...] in one batched target pass; accept each kept prefix plus the
target's own next token; commit each sequence's caches to exactly its accepted text (in `finally`); let each
proposer adapt, and measure what the step cost (the draft-length policy's input).

Cache rule: a sequence's target slot holds every token of its text except the last one, which is fed at the
head of the next round, so row 0 of a round's logits scores the first draft token.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from draftwise.adaptive import DraftLengthPolicy
from draftwise.estimates import DRAFT_ESTIMATE, Acceptance, decayed
from draftwise.backends.base import SharedBackend
from draftwise.backends.hf import HFBackend, embedding_rows
from draftwise.backends.prefix_cache import PrefixCache
from draftwise.config import GenerationConfig
from draftwise.errors import DraftwiseError
from draftwise.grammar import GrammarCompiler
from draftwise.methods import DRAFT_MODEL, Parts, available_methods, check_method, needs, new_proposer
from draftwise.metrics import Stats
from draftwise.proposers.base import Proposer
from draftwise.proposers.batch import propose_many
from draftwise.proposers.proposal_cache import ProposalCache
from draftwise.sampling import make_generator
from draftwise.sequence import Sequence
from draftwise.text import TextStream
from draftwise.tokenizers import CROSS_TOKENIZER, check_draft_reads_every_token, encode_prompt, readable_ids
from draftwise.types import Draft, Event, Verdict
from draftwise.verify.batch import DraftBatch, verify_batch

# A draft at most this many tokens behind its text catches up in its round's first draft forward; one further
# behind sits rounds out (k = 0) while it catches up in prefill-sized chunks (Engine.catch_up_draft), since in a
# batched draft forward every row pays for the widest one.
MAX_DRAFT_LAG = 16
# How far behind (the text's last token aside) drafting itself leaves a draft: a round that kept every guess leaves
# the last one unfed. A round's first draft forward feeds it with the text's last token.
ROUND_FEED = 1
TEXT_CONTEXT = 5  # the prompt's last ids, decoded ahead of the text (TextStream: a continuation's leading space)


@dataclass(frozen=True)
class Result:
    text: str
    token_ids: list[int]
    stats: Stats
    finish_reason: str


@dataclass
class StepTimes:
    """Where one step's seconds went, for the server's metrics."""

    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0


class Engine:
    def __init__(self, target: SharedBackend, tokenizer, proposer: Proposer | None, method: str, eos: frozenset[int],
                 max_context: int | None = None, speed_paths: dict | None = None):
        """speed_paths: which speed paths were chosen at load (dtype, kernels, draft vocabulary), for the stats.

        target and proposer serve the first live sequence (so a single stream needs no slot of its own); every
        other live sequence gets its own slot of the target and its own proposer (proposer.fork())."""
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.method = method
        self.eos = eos
        self.max_context = max_context or target.max_context  # the smallest context of the models involved
        self.readable_ids = readable_ids(tokenizer, target.embedding_rows)  # the ids a prompt of token ids may hold
        # Structured output's matchers (llguidance's view of the tokenizer is built at the first grammar).
        self.grammars = GrammarCompiler(tokenizer, max(target.embedding_rows, len(tokenizer)), eos)
        self.speed_paths = dict(speed_paths or {})
        self._default_in_use = False
        self.open_sequences = 0  # sequences open now (catch_up_rows)
        self._step_rows: float | None = None  # rows of the recent steps, decayed (catch_up_rows)
        self.last_step = StepTimes()
        self.draft_policy = DraftLengthPolicy()  # the step's drafter's (_step_policy); first, the engine's method's
        # drafter (_pool_method) -> its policy: choices, probes, savings and draft forwards of its own, priced over
        # the one table of target passes (StepCosts.sharing_passes), so that what one method learnt in a server does
        # not steer the next one's choices.
        self._policies: dict[str, DraftLengthPolicy] = {_pool_method(method, None): self.draft_policy}
        # (method, greedy) -> each estimate's name (_estimates) -> the acceptance of its earlier sequences, each folded
        # in whole and decayed by sequence: where the next one of that kind starts (recent_acceptance, start_from).
        # (A draft loaded beside the engine's own keeps pools of its own: method "draft@name".)
        self._carried: dict[tuple[str, bool], dict[str, Acceptance]] = {}
        self._answer_tokens: float | None = None  # how many tokens finished answers ran, decayed (_tokens_to_come)
        self.prompt_cache: PrefixCache | None = None  # enable_prompt_cache() turns it on
        self.proposal_cache: ProposalCache | None = None  # enable_proposal_cache() turns it on
        # Called with (seq, draft, verdict, step times) after each verified round, before its tokens join the
        # text (so len(seq.context) is where the draft starts): the server's proposal log.
        self.round_observer: Callable[[Sequence, Draft, Verdict, StepTimes], None] | None = None
        # Called with (seq, start, features [n, H]) as the target's last hidden states at positions start .. start +
        # n - 1 of a sequence's text are computed (its prompt's at prefill, its kept positions at each verification):
        # the server's feature capture (serve/feature_capture.py). Set, every pass returns them.
        self.feature_sink: Callable[[Sequence, int, torch.Tensor], None] | None = None
        # The server's fallback: a proposer that raises (or, with draft_timeout_s, drafts too slowly) is dropped
        # and its sequence goes on with the target alone, still exact. Off, a proposer's error ends the request.
        self.fall_back_on_proposer_error = False
        self.draft_timeout_s: float | None = None
        # Draft models loaded beside the engine's own (add_draft: a distilled version on trial), by name; and how the
        # engine makes one (loading.draft_maker; None where no other draft can join: no draft model, or one with
        # another tokenizer).
        self._drafts: dict[str, Callable] = {}
        self.draft_maker: Callable | None = None
        self.draft_in_front: str | None = None  # the loaded draft that draft-model methods use unless told (promote_draft)
        # Drafts removed since they were loaded: a request that named one while it was there (a trial's, queued when
        # the trial ended) drafts with the one in front instead; the text is the same either way.
        self._retired: set[str] = set()

    @property
    def methods_available(self) -> tuple[str, ...]:
        """The methods a sequence may ask for: the target alone and lookup always, the draft model's with a
        draft, the head's with a head, skip and hybrid-skip on an engine built for either (the skip draft's plan is
        calibrated at load); a draft with another tokenizer than the target's drafts no trees."""
        return available_methods(self.method, self.target.backend_name,
                                 draft_chains_only=self.speed_paths.get("draft_tokenizer") == CROSS_TOKENIZER)

    @property
    def drafts_available(self) -> tuple[str, ...]:
        """The draft models a sequence may name (GenerationConfig.draft) beside the engine's own."""
        return tuple(self._drafts)

    def add_draft(self, name: str, draft_model) -> None:
        """Load draft_model (floats, sharing the target's tokenizer) beside the engine's own draft, on the same kernels,
        for sequences that name it: a candidate's trial. The output stays the target's whatever the draft. May run on
        another thread than the model loop: the draft is made ready first, and only then named."""
        if self.draft_maker is None:
            raise DraftwiseError("this engine drafts with no draft model of the target's tokenizer, so no other can "
                                 "be loaded beside it (serve a draft-model method with a --draft)")
        check_draft_reads_every_token(self.tokenizer, self.target.embedding_rows, embedding_rows(draft_model))
        on_draft, backend = self.draft_maker(draft_model, {})
        if backend.max_context < self.max_context:
            raise DraftwiseError(f"draft {name!r} reads {backend.max_context} positions, fewer than this engine's "
                                 f"{self.max_context}")
        if self.prompt_cache is not None:  # its prompts' keys and values kept as the engine's own draft's are
            backend.prefix_cache, backend.prefix_name = self.prompt_cache, f"draft@{name}"
        self._drafts = {**self._drafts, name: on_draft}  # (replaced whole: readers on the model thread see either)
        self._retired.discard(name)

    def remove_draft(self, name: str) -> None:
        """Sequences open on it go on with it to their end; new ones can no longer name it."""
        if name == self.draft_in_front:
            raise DraftwiseError(f"draft {name!r} is the one in front: promote another first")
        self._drafts = {key: value for key, value in self._drafts.items() if key != name}
        self._retired.add(name)

    def promote_draft(self, name: str | None) -> None:
        """Put a loaded draft in front: the draft-model methods draft with it unless a sequence names another (None:
        the engine's own again). Open sequences finish on the draft they started with."""
        if name is not None and name not in self._drafts:
            raise DraftwiseError(f"draft {name!r} is not loaded here")
        self.draft_in_front = name

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
        """Wrap transformers models already in memory. options: those of loading.assemble; draft_tokenizer=, the
        draft's own tokenizer where it may differ from the target's (then it drafts through text)."""
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

    def stream(self, prompt: str | list[int] | list[dict], *, chat: bool = False, trust_special_tokens: bool = False,
               **options) -> Iterator[Event]:
        """Yield one Event per emitted token, then a final Event with the finish reason and stats.

        Control tokens spelled in the prompt's text or messages (`<|im_end|>`) are read as plain text, so that text
        from users cannot close a turn or open one; trust_special_tokens=True reads them as the tokens, for text the
        caller wrote (request_text.py). Token ids are taken as they are.

        options: those of GenerationConfig.from_options (max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
        num_draft_tokens=DEFAULT_DRAFT_TOKENS, both in config.py; temperature=0, top_k=0, top_p=1, seed, stop,
        ignore_eos, adaptive=True, method, grammar: a grammar.Grammar the text must match). adaptive: num_draft_tokens is the most
        per round, and each round drafts the number that the measured acceptance and costs say pays best (none
        when speculation does not pay); False drafts it every round.
        """
        cfg = GenerationConfig.from_options(**options)
        prompt_ids = encode_prompt(self.tokenizer, prompt, chat, trust_special_tokens)
        self.check_open(prompt_ids, cfg)  # bad options raise at the call, not at the first token
        return self._run(prompt_ids, cfg)

    def _run(self, prompt_ids: list[int], cfg: GenerationConfig) -> Iterator[Event]:
        # Opened at the first token, not at the call: a stream never iterated holds no slot (its finally never runs).
        seq = self.open_sequence(prompt_ids, cfg)
        try:
            while not seq.prefill_done:
                self.prefill(seq)
            # Alone, there is no batch to spare the draft's prefill for; it is prefill too (on a long prompt the draft
            # model's prefill costs seconds, which decode's tokens/s would otherwise hide).
            seq.stats.prefill_s += self._timed_catch_up(seq)
            while seq.finish is None:
                if self.wants_catch_up(seq, alone=True):
                    seq.stats.decode_s += self._timed_catch_up(seq)  # drafting's work, while decoding
                events = self.step([seq])[seq]
                if seq.finish == "error":
                    raise seq.exception
                yield from events
        finally:
            self.close_sequence(seq)

    # -- sequences ---------------------------------------------------------------------------------------
    def open_sequence(self, prompt_ids: list[int], cfg: GenerationConfig) -> Sequence:
        """A live sequence with its own cache slots and proposer; checked before anything is allocated."""
        if cfg.draft in self._retired:
            cfg = replace(cfg, draft=None)
        method = self.check_open(prompt_ids, cfg)
        if cfg.draft is None and self.draft_in_front is not None and needs(method, DRAFT_MODEL):
            cfg = replace(cfg, draft=self.draft_in_front)  # (the sequence's record of the draft it drafts with)
        constraint = None if cfg.grammar is None else self.grammars.constraint(cfg.grammar)
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
                proposer.begin(prompt_ids, cfg.sampling, generator)
                proposer.follow_grammar(None if constraint is None else constraint.guide())
            reused = self._restore_prompt(target, proposer, prompt_ids)
        except BaseException:  # nothing allocated here may outlive a sequence that never opened
            self._release(target, proposer)
            raise
        # A seeded sampled request drafts a fixed k: its random draws depend on the round shapes, which an
        # adaptive k would take from timings, and the same seed must give the same text.
        seeded = not cfg.sampling.greedy and cfg.sampling.seed is not None
        acceptance = Acceptance() if proposer and cfg.adaptive and not seeded else None
        policy = self._policy_for(_pool_method(method, cfg.draft))
        if acceptance is not None:
            policy.sequence_joined()
        if proposer is not None:  # a tree's width, lookup's depth, a hybrid's pick: by what steps cost here
            proposer.price_with(policy.costs, follow=acceptance is not None)  # (not for a fixed k)
        stats = Stats(method=method, num_draft_tokens=cfg.num_draft_tokens, prompt_tokens=len(prompt_ids),
                      speed_paths=self.speed_paths, prompt_cached=reused)
        seq = Sequence(prompt_ids=list(prompt_ids), cfg=cfg, method=method, target=target, proposer=proposer,
                       acceptance=acceptance, text=TextStream(self.tokenizer, cfg.stop, prompt_ids[-TEXT_CONTEXT:]),
                       stats=stats, generator=generator, context=list(prompt_ids), prefilled=reused,
                       constraint=constraint)
        if acceptance is not None:
            pooled = self._carried.get((_pool_method(method, cfg.draft), cfg.sampling.greedy), {})
            _start_estimates(seq, {name: estimate.rate for name, estimate in pooled.items()})
        self.open_sequences += 1
        return seq

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
        if cfg.draft is not None:
            if not needs(method, DRAFT_MODEL):
                raise DraftwiseError(f"method {method!r} drafts with no draft model; a draft is named for "
                                     f"{', '.join(m for m in self.methods_available if needs(m, DRAFT_MODEL))}")
            if cfg.draft not in self._drafts:
                raise DraftwiseError(f"draft {cfg.draft!r} is not loaded here; loaded beside the engine's own: "
                                     f"{', '.join(self._drafts) or 'none'}")
        return method

    # -- the prompt cache --------------------------------------------------------------------------------
    def enable_prompt_cache(self, max_bytes: int) -> PrefixCache:
        """Reuse the keys and values of earlier texts for prompts that start the same way, in the target and in
        the draft model (one byte budget for both; see backends/prefix_cache.py)."""
        self.prompt_cache = PrefixCache(max_bytes)
        if isinstance(self.target, HFBackend):
            self.target.prefix_cache, self.target.prefix_name = self.prompt_cache, "target"
        if self.proposer is not None:  # (a draft model's cache, a hybrid's too)
            self.proposer.attach_prompt_cache(self.prompt_cache)
        return self.prompt_cache

    # -- the proposal cache ------------------------------------------------------------------------------
    def enable_proposal_cache(self, max_tokens: int) -> ProposalCache:
        """Let prompt lookup (methods lookup and lookup-tree, and every hybrid's lookup rounds) propose from the texts
        of earlier sequences too, the last max_tokens tokens of them (see proposers/proposal_cache.py)."""
        self.proposal_cache = ProposalCache(max_tokens)
        if self.proposer is not None:  # (lookup's, a hybrid's lookup's; the sequences' own get it as they open)
            self.proposer.attach_corpus(self.proposal_cache)
        return self.proposal_cache

    def _restore_prompt(self, target, proposer, prompt_ids: list[int]) -> int:
        """How much of the prompt (of all but its last token) the target got from the prompt cache; the draft gets
        what the cache holds of that prefix for it. Chunked prefill (and the draft's catch-up) does the rest."""
        if self.prompt_cache is None:
            return 0
        reused = target.restore(prompt_ids[:-1])
        if reused and _keeps_cache(proposer):
            proposer.restore(prompt_ids[:reused])
        return reused

    def _remember_prompt(self, seq: Sequence) -> None:
        """Offer a sequence's caches to the prompt cache as it leaves (they hold its text but the last token)."""
        if self.prompt_cache is None or seq.finish == "error":
            return
        seq.target.remember(seq.context[:-1])
        if _keeps_cache(seq.proposer):
            seq.proposer.remember()

    def close_sequence(self, seq: Sequence) -> None:
        """Give the sequence's slots back (once); the engine's own slot and proposer become free for the next."""
        if seq.target is None:
            return
        try:
            self._carry_acceptance(seq)
            self._count_answer(seq)
            self._remember_prompt(seq)
            if self.proposal_cache is not None and seq.finish not in (None, "error"):
                self.proposal_cache.add(seq.context)
        finally:  # the caches are offered what they may keep; the slots go back whatever happened there
            self._release(seq.target, seq.proposer)
            seq.target = None
            self.open_sequences -= 1

    def _count_answer(self, seq: Sequence) -> None:
        """Fold a finished answer's length into what _tokens_to_come expects (not a failed or cancelled one's)."""
        if seq.finish in (None, "error", "cancelled"):
            return
        self._answer_tokens = decayed(self._answer_tokens, float(seq.stats.new_tokens))

    def recent_acceptance(self, method: str, greedy: bool, estimate: str = DRAFT_ESTIMATE) -> float | None:
        """The per-token acceptance of this engine's earlier adaptive sequences of this method, greedy or sampled
        (sampling keeps fewer draft tokens), over all their rounds, the latest sequences weighing most; None before
        any drafted. Why over whole sequences: one that turned drafting off ended on the low rate that did it.
        estimate: which of a sequence's estimates (_estimates: a hybrid keeps lookup's too, by match length)."""
        pooled = self._carried.get((method, greedy), {}).get(estimate)
        return None if pooled is None else pooled.rate

    def _carry_acceptance(self, seq: Sequence) -> None:
        """Fold a leaving adaptive sequence's estimates into recent_acceptance (each that saw no round: nothing)."""
        if seq.acceptance is None:
            return
        pools = self._carried.setdefault((_seq_pool(seq), seq.cfg.sampling.greedy), {})
        for name, estimate in _estimates(seq).items():
            if estimate.observed_rate is not None:
                # From the prior, as a sequence's own estimate: a pool that has seen one probe keep its one token
                # would start every newcomer at a = 1.0 (the quant backend at 8 rows then priced drafting 4 tokens
                # twice as fast as a plain step, and filled 8 drafts for rounds that ran at a third of it).
                pools.setdefault(name, Acceptance()).fold(estimate.kept, estimate.rejections)

    def _release(self, target, proposer) -> None:
        if target is self.target.default:
            self._default_in_use = False
        else:
            target.close()
            if proposer is not None:
                proposer.release()

    def _new_proposer(self, method: str, draft: str | None = None) -> Proposer | None:
        """A proposer for a sequence that does not get the engine's own: a fork of it, or one of another method
        that the engine's models serve (methods_available), made by the method's entry in methods.py from parts
        the engine's proposer forks: a new slot of its draft model (or of the draft named, add_draft), or its head
        or skip draft (a hybrid's too)."""
        own = self.proposer
        if own is not None and method == self.method and draft is None:
            return own.fork()
        on_draft = self._drafts[draft] if draft is not None else None if own is None else own.fork_on_draft_model
        parts = Parts(on_draft_model=on_draft, drafter=None if own is None else own.fork_drafter,
                      corpus=self.proposal_cache)
        return new_proposer(method, parts)

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

    # -- prefill -----------------------------------------------------------------------------------------
    def prefill(self, seq: Sequence, max_tokens: int | None = None) -> None:
        """Put (up to max_tokens more of) the prompt, all but its last token, into the target's cache; once it is
        there, into the draft's, for a sequence that drafts a fixed k (see Sequence.prefill_done). A server
        prefills in chunks so a long prompt does not stall the sequences already decoding."""
        started = time.perf_counter()
        done = seq.prefilled
        end = len(seq.prompt_ids) - 1 if max_tokens is None else min(len(seq.prompt_ids) - 1, done + max_tokens)
        if end > done:
            reads = _reads_features(seq.proposer)
            features = seq.target.append(seq.prompt_ids[done:end], hidden=reads or self.feature_sink is not None)
            if features is not None and reads:
                seq.proposer.add_features(done, features)
            if features is not None and self.feature_sink is not None:
                self.feature_sink(seq, done, features)
            seq.prefilled = end
        elif seq.acceptance is None:
            self.catch_up_draft(seq, max_tokens)
        seq.stats.prefill_s += time.perf_counter() - started

    def wants_catch_up(self, seq: Sequence, alone: bool = False) -> bool:
        """Whether to fill the sequence's lagging draft now: its drafter's policy chose to speculate at its last step
        and the draft is too far behind to catch up in its round, or the sequence decodes alone and its next step may
        be a probe. A draft more than MAX_DRAFT_LAG behind would sit the probe out (as the gap between probes doubles
        past it, every later probe of a long request would learn nothing); a nearer one would catch up in the
        probe's first draft forward, which is timed as drafting: the probe would price the draft's forward well
        above what it costs, and keep drafting off for the rest of the request. So before a probe
        the draft is filled to the text (less the tokens a round's first forward feeds anyway). In a batch, a
        probe is not worth every row's catch-up. A sequence drafting a fixed k always drafts, and its rounds must
        not follow the engine's state (a seeded request's draws depend on them): its draft is filled whenever it
        is too far behind (a hybrid's lookup rounds leave it behind), whatever the policy last chose. Else a draft is
        filled only where the tokens still to come repay the filling (DraftLengthPolicy.catch_up_pays): in a batch,
        where drafting saves little a token, a short answer to a long prompt is cheaper without its draft."""
        if seq.acceptance is None:
            return seq.proposer is not None and seq.draft_behind > MAX_DRAFT_LAG
        policy = self._policy_for(_seq_pool(seq))
        if alone and policy.probe_due:
            return seq.draft_behind > ROUND_FEED
        return (policy.wants_drafting and seq.draft_behind > MAX_DRAFT_LAG
                and policy.catch_up_pays(seq.draft_behind, self._tokens_to_come(seq), self.catch_up_rows))

    @property
    def catch_up_rows(self) -> float:
        """The batch a lagging draft would draft in, which its filling is priced at: the sequences open now, or the
        recent steps' rows where those were more. Between one request's end and the next one's arrival a server at
        2 requests has 1 open, where drafting saves far more a token than at 2; priced there, every draft would be
        filled in that gap and never used (on the quant backend at 2 requests: 13 fillings, 3% of the run)."""
        return max(self.open_sequences, self._step_rows or 0.0)

    def _tokens_to_come(self, seq: Sequence) -> float:
        """What a sequence has still to emit, as far as can be told: the rest of its limit, but no more than the
        engine's finished answers ran (a chat without max_tokens may run to the end of the context; few do), or than
        it has run already where it has outlived them."""
        if self._answer_tokens is None:
            return seq.remaining
        return min(seq.remaining, max(self._answer_tokens, seq.stats.new_tokens))

    def catch_up_draft(self, seq: Sequence, max_tokens: int | None = None) -> None:
        """Feed (up to max_tokens of) the text the sequence's draft cache lacks, all but the last token."""
        behind = seq.draft_behind
        if not behind:
            return
        start = len(seq.context) - 1 - behind
        tokens = seq.context[start: start + min(behind, max_tokens or behind)]
        started = time.perf_counter()
        try:
            seq.proposer.extend(tokens)
        except Exception as err:  # a failing draft is the proposer's fault: with fallback on, the target goes on
            if not self.fall_back_on_proposer_error:
                raise
            self._fall_back(seq, err)
        else:  # (what reading costs a token, which catch_up_pays weighs)
            self._policy_for(_seq_pool(seq)).costs.observe_catch_up(len(tokens), time.perf_counter() - started)

    def _timed_catch_up(self, seq: Sequence) -> float:
        """catch_up_draft(seq); the seconds it took."""
        started = time.perf_counter()
        self.catch_up_draft(seq)
        return time.perf_counter() - started

    # -- one round for a batch of sequences --------------------------------------------------------------
    def step(self, seqs: list[Sequence]) -> dict[Sequence, list[Event]]:
        """One round for every sequence (each prefilled, none finished): propose, verify all drafts in one
        target pass, commit each sequence's caches, adapt the step costs, accept the kept tokens. Returns each
        sequence's events; a sequence that ended gets its final event, and one whose round failed ends with finish
        "error" (seq.exception holds why) while the others go on."""
        started = time.perf_counter()
        self._step_rows = decayed(self._step_rows, len(seqs))
        ks = self._draft_lengths(seqs)  # how much each drafts: what the measured costs and acceptance say pays
        chosen = time.perf_counter()
        drafts = self._propose(seqs, ks)  # each sequence's Draft, or the exception that ended its round
        proposed = time.perf_counter()
        too_slow = self._fall_back_where_drafting_failed(seqs, drafts, ks, proposed - chosen)
        live = [i for i, d in enumerate(drafts) if not isinstance(d, BaseException)]
        verdicts: dict[int, Verdict] = {}
        features: dict[int, torch.Tensor] = {}
        timed = True  # (a pass run again row by row is not the shape the step costs price)
        failed: dict[int, Exception] = {}  # sequences whose caches failed to commit the verdict
        # A sampled row's draws, as they were before the pass: a row verified again alone draws them again, so a
        # seeded text does not depend on whether a batch-mate's row failed the shared verification.
        draws = {i: seqs[i].generator.get_state() for i in live if not seqs[i].cfg.sampling.greedy}
        try:  # verify: every live draft in one target pass, each row's verdict the verifier's (exact)
            try:
                verdicts, features = self._verify(seqs, drafts, live)
            except Exception as err:
                timed = False
                verdicts, features = self._verify_alone(seqs, drafts, live, err, draws)
        finally:  # commit: whatever happened, each sequence's caches hold exactly its accepted text
            verified = time.perf_counter()
            for i, seq in enumerate(seqs):
                try:
                    self._commit_caches(seq, ks[i], drafts[i], verdicts.get(i), features.get(i), self.feature_sink)
                except Exception as err:  # this sequence's alone: it ends with it, its target holding the text
                    seq.target.trim(len(seq.context) - 1)
                    failed[i] = err
            for seq in too_slow:  # their drafts were good, and are used: the next rounds go without
                self._fall_back(seq, TimeoutError(f"drafting took {1000 * (proposed - chosen):.0f} ms, over the "
                                                  f"{1000 * self.draft_timeout_s:.0f} ms limit"))
        times = StepTimes(proposed - chosen, verified - proposed)  # (the choice is the step's overhead, below)
        if verdicts and timed:  # adapt: what this shape of step cost, which the next rounds' lengths are priced by
            self._observe_costs(seqs, drafts, ks, live, times)
        for i, err in failed.items():  # (after the costs: the pass itself ran for them)
            drafts[i] = err
            verdicts.pop(i, None)
        # accept: each text grows by its kept draft tokens and the target's own next token (and acceptance learns)
        events = {seq: self._emit_alone(seq, drafts[i], verdicts.get(i), ks[i], times) for i, seq in enumerate(seqs)}
        times.total_s = time.perf_counter() - started
        if verdicts and timed:  # what the step cost beside drafting and its pass, which every step pays
            drafted = any(len(drafts[i]) for i in verdicts)
            self.draft_policy.costs.observe_overhead(len(verdicts), drafted,
                                                     times.total_s - times.draft_s - times.verify_s)
            emitted = sum(event.token_id is not None for row in events.values() for event in row)
            self.draft_policy.observe_outcome(emitted, times.total_s)  # (what the choice's price promised, run)
        for seq in seqs:
            seq.stats.decode_s += times.total_s
        self.last_step = times
        return events

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft | BaseException]:
        """Each sequence's draft of (up to) its k tokens, draft-model sequences sharing each draft forward; a
        proposer's error is its sequence's result, not the step's."""
        stop = self.draft_policy.stop_confidence(len(seqs))
        stops = [stop if seq.acceptance else 0.0 for seq in seqs]
        drafts = propose_many([seq.proposer for seq in seqs], [seq.context for seq in seqs], ks, stops)
        for i, seq in enumerate(seqs):  # a tree may be wider than k: the pass writes a position per node
            if isinstance(drafts[i], Draft):
                drafts[i] = drafts[i].prefix(self.max_context - len(seq.context))
                if seq.constraint is not None and seq.proposer is not None:  # (`none` steps alone)
                    room = min(seq.remaining - 1, self.max_context - len(seq.context))
                    try:
                        drafts[i] = seq.constraint.shape(drafts[i], room)
                    except DraftwiseError as err:  # (a grammar that cannot go on ends its own sequence)
                        drafts[i] = err
        return drafts

    def _observe_costs(self, seqs: list[Sequence], drafts: list, ks: list[int], live: list[int],
                       times: StepTimes) -> None:
        """Fold the step's seconds into the policy's costs: the pass is as wide as its widest draft (a tree's every
        node), drafted in up to max(k) forwards, of rounds that ran any (a lookup guess runs none)."""
        drafting = [i for i in live if ks[i] and not _drafted_free(seqs[i].proposer)]
        steps = max((ks[i] for i in drafting), default=0)
        if len({_seq_pool(seqs[i]) for i in drafting}) > 1:
            steps = 0  # drafters of different kinds drafted together: their forwards are no one's own price
        self.draft_policy.costs.observe(len(live), max(len(drafts[i]) for i in live), times.draft_s, times.verify_s,
                                        draft_steps=steps)

    def _policy_for(self, pool: str) -> DraftLengthPolicy:
        """A drafter's (_pool_method) policy, its costs a view of the engine's one table of passes."""
        if pool not in self._policies:
            self._policies[pool] = DraftLengthPolicy(costs=self.draft_policy.costs.sharing_passes())
        return self._policies[pool]

    def _step_policy(self, seqs: list[Sequence]) -> DraftLengthPolicy:
        """The policy a step of these rows is priced and timed by: that of the drafter most of its drafting rows
        share (a mix is priced by its largest kind); with none drafting, the last step's."""
        pools = [_seq_pool(seq) for seq in seqs if seq.proposer is not None]
        if not pools:
            return self.draft_policy
        return self._policy_for(max(set(pools), key=pools.count))

    def _fall_back_where_drafting_failed(self, seqs: list[Sequence], drafts: list, ks: list[int],
                                         draft_s: float) -> list[Sequence]:
        """With fallback on: a sequence whose proposer raised takes this round with an empty draft and the rest
        without a proposer. Returns the sequences that drafted in a step slower than the draft timeout."""
        if not self.fall_back_on_proposer_error:
            return []
        for i, seq in enumerate(seqs):
            if isinstance(drafts[i], BaseException):
                self._fall_back(seq, drafts[i])
                drafts[i], ks[i] = Draft(token_ids=()), 0
        slow = self.draft_timeout_s is not None and draft_s > self.draft_timeout_s
        return [seq for seq, k in zip(seqs, ks) if slow and k > 0]

    def _fall_back(self, seq: Sequence, err: BaseException) -> None:
        """The sequence goes on with the target alone (its proposer's caches were settled by its round)."""
        if seq.proposer is not self.proposer:
            seq.proposer.release()
        seq.proposer, seq.acceptance = None, None
        seq.stats.fallback = f"{type(err).__name__}: {err}"

    def _draft_lengths(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's k. The target pass pads every row to the widest, so adaptive sequences share one k,
        the policy's choice for this many rows; the others draft their own cfg.num_draft_tokens. Rows whose round
        is settled first (_settled_rounds: prompt lookup's, and those whose draft lags) make their free guesses
        before it: their nodes widen the pass the shared k is priced by."""
        rows, depths = len(seqs), [_free_depth(seq) for seq in seqs]
        for seq, depth in zip(seqs, depths):  # how deep a free guess may go, and the rows its guesses are priced in
            if seq.proposer is not None:
                seq.proposer.prepare_round(depth, rows)
        settled = self._settled_rounds(seqs, depths)
        everyone = [seq for seq in seqs if seq.proposer is not None and seq.acceptance and not _judges_rounds(seq)]
        # Where none of them can draft (every draft lags), priced as if they could: whether drafting would pay is
        # what decides if their drafts are filled (wants_catch_up); their k is 0 whatever the choice.
        adaptive = [seq for seq in everyone if seq not in settled] or everyone
        self.draft_policy = self._step_policy(everyone or seqs)
        fixed = [seq.cfg.num_draft_tokens for seq in seqs
                 if seq.proposer is not None and not seq.acceptance and seq.draft_behind <= MAX_DRAFT_LAG]

        def priced(choice, rows_drafting: list[Sequence]) -> int:
            return choice([_drafting_acceptance(seq).rate for seq in rows_drafting],
                          max(seq.cfg.num_draft_tokens for seq in rows_drafting), rows,
                          fixed, [seq.spread.side_nodes for seq in rows_drafting],
                          [seq.proposer.armed_nodes for seq in settled if seq not in rows_drafting])

        shared = priced(self.draft_policy.choose, adaptive) if adaptive else 0
        if len(adaptive) < len(everyone):  # whether to fill the lagging drafts: judged as if all were filled
            priced(self.draft_policy.judge, everyone)
        ks = [0 if seq.proposer is None or seq.draft_behind > MAX_DRAFT_LAG else
              min(shared if seq.acceptance else seq.cfg.num_draft_tokens, depth)
              for seq, depth in zip(seqs, depths)]
        return [settled[seq] if seq in settled else k or _free_round(seq, depth, rows)
                for seq, k, depth in zip(seqs, ks, depths)]

    def _settled_rounds(self, seqs: list[Sequence], depths: list[int]) -> dict[Sequence, int]:
        """The adaptive sequences whose round is their free guess or nothing, whatever k the others share: prompt
        lookup's methods, which judge every round (_judges_rounds), and those whose draft lags more than
        MAX_DRAFT_LAG behind its text (it sits the round out, and catches up between steps, catch_up_draft, if
        ever). Priced among the drafting rows, a lagging row would count as drafting in a step where it runs plain:
        the quant backend at 4 rows chose to draft a token in steps where no row could. Each one's k (0: a plain
        row; else its armed guess)."""
        return {seq: _free_round(seq, depth, len(seqs)) for seq, depth in zip(seqs, depths)
                if _judges_rounds(seq) or (seq.acceptance and seq.draft_behind > MAX_DRAFT_LAG)}

    def _verify(self, seqs: list[Sequence], drafts: list,
                live: list[int]) -> tuple[dict[int, Verdict], dict[int, torch.Tensor]]:
        """Each live sequence's verdict, and for those whose proposer reads the target's features (every one, with a
        feature_sink), the pass's features of its row ([n_i, H])."""
        if not live:
            return {}, {}
        rows = [(seqs[i].target, [seqs[i].context[-1], *drafts[i].token_ids]) for i in live]
        trees = [drafts[i].layout for i in live]
        hidden = self.feature_sink is not None or any(_reads_features(seqs[i].proposer) for i in live)
        out = self.target.forward_batch(rows, trees=trees, hidden=hidden)
        per_row, features = out if hidden else (out, [])
        # A grammar's mask on p at every position the row scores: the verdict is then the constrained target's.
        per_row = [row if seqs[i].constraint is None else seqs[i].constraint.mask(row, drafts[i])
                   for i, row in zip(live, per_row)]
        batch = DraftBatch.of([drafts[i] for i in live])
        found = verify_batch(batch, torch.cat(per_row),  # [T + B, vocab]
                             [seqs[i].cfg.sampling for i in live], [seqs[i].generator for i in live])
        return dict(zip(live, found)), dict(zip(live, features))

    def _verify_alone(self, seqs: list[Sequence], drafts: list, live: list[int], shared_error: Exception,
                      draws: dict[int, torch.Tensor]) -> tuple[dict[int, Verdict], dict[int, torch.Tensor]]:
        """The shared target pass failed: each of its rows once more on its own, so that what one sequence alone
        brings (a prompt or draft the model cannot take) ends its own round, not every request in the batch. A row
        that fails alone gets its own error in place of its draft; a single row's shared error is its own. draws:
        the sampled rows' generator states from before the shared pass, which may have drawn for some rows."""
        if len(live) == 1:
            drafts[live[0]] = shared_error
            return {}, {}
        verdicts, features = {}, {}
        for i in live:
            seqs[i].target.trim(len(seqs[i].context) - 1)  # the shared pass may have written its row: the text only
            if i in draws:
                seqs[i].generator.set_state(draws[i])
            try:
                verdict, feature = self._verify(seqs, drafts, [i])
            except Exception as own:
                drafts[i] = own
                continue
            verdicts.update(verdict)
            features.update(feature)
        return verdicts, features

    @staticmethod
    def _commit_caches(seq: Sequence, k: int, draft, verdict: Verdict | None,
                       features: torch.Tensor | None = None, sink=None) -> None:
        """Both caches hold exactly the accepted text, even when the round failed. A proposer that reads the
        target's features gets those of the kept positions (the text's last token and the accepted drafts), and
        so does the engine's feature_sink. The proposer hears of its own tokens only: what a grammar forced after
        them is text it catches up on."""
        base = len(seq.context) - 1
        kept = verdict.num_accepted if verdict else 0
        path = list(range(kept)) if verdict is None or verdict.path is None else list(verdict.path)
        if path != list(range(kept)):
            seq.target.keep(base + 1, [base + 1 + node for node in path])  # a tree's path, into place
        seq.target.trim(base + 1 + kept if verdict else base)
        reads = _reads_features(seq.proposer)
        if verdict is not None and features is not None and (reads or sink is not None):
            kept_features = features[[0, *(1 + node for node in path)]]  # [kept + 1, H]
            if reads:
                seq.proposer.add_features(base, kept_features)
            if sink is not None:
                sink(seq, base, kept_features)
        if k > 0:
            own = draft.own if isinstance(draft, Draft) else kept
            if verdict is not None:  # (a tree drafted in the proposer's own cache keeps its path there)
                seq.proposer.keep_path(path[:own])
            seq.proposer.observe(min(kept, own))

    def _emit_alone(self, seq: Sequence, draft, verdict: Verdict | None, k: int, times: StepTimes) -> list[Event]:
        """_emit, where what fails ends this sequence alone (with its error), not the batch's step."""
        try:
            return self._emit(seq, draft, verdict, k, times)
        except Exception as err:
            return self._emit(seq, err, None, k, times)

    def _emit(self, seq: Sequence, draft, verdict: Verdict | None, k: int, times: StepTimes) -> list[Event]:
        if verdict is None:  # the round failed: the sequence ends here, its caches already consistent
            seq.finish, seq.exception = "error", draft
            seq.error = f"{type(draft).__name__}: {draft}"
            return [Event(token_id=None, text="", finish_reason="error", stats=seq.stats, error=seq.error)]
        seq.stats.draft_s += times.draft_s
        seq.stats.verify_s += times.verify_s
        draft, verdict, forced = _proposers_part(draft, verdict)  # (a grammar's forced tail apart)
        if self.round_observer is not None and draft.token_ids:
            try:
                self.round_observer(seq, draft, verdict, times)
            except Exception:  # a record of the round is never worth the request
                pass
        if seq.acceptance:
            seq.acceptance.observe(draft.depth, verdict.num_accepted)
            if not seq.proposer.drafted_free:  # a lookup guess is not what the shared k prices
                seq.spread.observe(len(draft), draft.depth)
        events = []
        for i, token in enumerate([*draft.accepted(verdict), *forced, verdict.next_token]):
            seq.context.append(token)
            seq.stats.new_tokens += 1
            piece = seq.text.add(token)
            seq.finish = self._finish_reason(token, seq)
            if seq.finish is not None:
                piece += seq.text.finish()
            events.append(Event(token_id=token, text=piece, from_draft=i < verdict.num_accepted + len(forced)))
            if seq.finish is not None:
                break
        if seq.constraint is not None:
            seq.constraint.advance([event.token_id for event in events])
        # Draft tokens cut off by an end (EOS, stop, length) were never kept.
        seq.stats.observe_draft(draft.depth, min(verdict.num_accepted, len(events)), nodes=len(draft))
        seq.stats.forced_tokens += max(0, min(len(forced), len(events) - verdict.num_accepted))
        if seq.finish is not None:
            events.append(Event(token_id=None, text="", finish_reason=seq.finish, stats=seq.stats))
        return events

    def _finish_reason(self, token: int, seq: Sequence) -> str | None:
        if seq.text.stopped:
            return "stop"
        if token in self.eos and not seq.cfg.ignore_eos:
            return "eos"
        if seq.stats.new_tokens >= seq.cfg.max_new_tokens:
            return "length"
        return None


def _pool_method(method: str, draft: str | None) -> str:
    """Whose acceptance a sequence starts from and adds to, and whose draft-length policy it follows: its method's,
    on the draft it drafts with."""
    return method if draft is None else f"{method}@{draft}"


def _seq_pool(seq: Sequence) -> str:
    return _pool_method(seq.method, seq.cfg.draft)


def _proposers_part(draft: Draft, verdict: Verdict) -> tuple[Draft, Verdict, list[int]]:
    """A round's draft and verdict as the proposer made and earned them, and the kept tokens that a grammar forced
    after its guesses (grammar.py: Constraint.shape); these only join the text (after the proposer's kept ones)."""
    if not draft.forced:
        return draft, verdict, []
    own = draft.own
    if verdict.num_accepted <= own:
        return draft.prefix(own), verdict, []
    forced = list(draft.token_ids[own: verdict.num_accepted])
    return draft.prefix(own), Verdict(own, verdict.next_token, verdict.path), forced


def _reads_features(proposer: Proposer | None) -> bool:
    """Whether a proposer drafts from the target's hidden states (the feature head), handed over by the engine."""
    return proposer is not None and proposer.capabilities.reads_target_features


def _keeps_cache(proposer: Proposer | None) -> bool:
    """Whether a proposer keeps its own cache of the text (a draft model's), which the prompt cache also serves."""
    return proposer is not None and proposer.capabilities.keeps_cache


def _drafted_free(proposer: Proposer | None) -> bool:
    """Whether the proposer's last round ran no draft forward (a lookup guess)."""
    return proposer is not None and proposer.drafted_free


def _free_round(seq: Sequence, k: int, rows: int) -> int:
    """k (at most the sequence's _free_depth) for an adaptive sequence whose draft model sits this round out, or
    whose proposer judges every round (prompt lookup's methods): its proposer's free guess (lookup's, which needs no
    draft forward and no draft cache) where that pays alone, else 0."""
    if not (seq.acceptance and k > 0 and seq.proposer.capabilities.guesses_free):
        return 0
    return seq.proposer.free_round(seq.context, k, rows)


def _judges_rounds(seq: Sequence) -> bool:
    """Whether an adaptive sequence's proposer decides each round itself, after its free guess (prompt lookup's
    methods): the shared k, priced by draft forwards and by an acceptance learnt only on drafted rounds, is not
    for it, and every round is a free round."""
    return seq.acceptance is not None and seq.proposer.capabilities.judges_rounds


def _free_depth(seq: Sequence) -> int:
    """The most a sequence drafts: its num_draft_tokens, and never past the last token it may emit (wasted work)."""
    return min(seq.cfg.num_draft_tokens, seq.remaining - 1)


def _estimates(seq: Sequence) -> dict[str, Acceptance]:
    """An adaptive sequence's acceptance estimates by name, what it carries to the next of its method: its
    proposer's where it keeps its own (lookup: by match length; a hybrid: its draft model's and its lookup's), else
    the sequence's."""
    if seq.proposer.capabilities.keeps_estimates:
        return seq.proposer.acceptances()
    return {DRAFT_ESTIMATE: _drafting_acceptance(seq)}


def _start_estimates(seq: Sequence, rates: dict[str, float]) -> None:
    """Start a new adaptive sequence's estimates from the rates its method's earlier sequences kept, by name."""
    if seq.proposer.capabilities.keeps_estimates:
        seq.proposer.start_acceptances(rates)
    else:
        _drafting_acceptance(seq).start_from(rates.get(DRAFT_ESTIMATE))


def _drafting_acceptance(seq: Sequence) -> Acceptance:
    """The acceptance the sequence's draft length follows: its proposer's own where it keeps one for the rounds
    that k prices (a hybrid's draft-model rounds), else the sequence's."""
    own = seq.proposer.drafting_acceptance
    return seq.acceptance if own is None else own
