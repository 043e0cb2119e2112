"""The engine: a facade over the speculative round (round.py) and the parts it keeps between rounds.

Construction wires the parts: the sequences' lifecycle (lifecycle.py), the draft-length policies (draft_lengths.py),
acceptance pooled across sequences (acceptance_pools.py), lagging drafts (catch_up.py), the prompt and proposal
caches (text_caches.py), drafts loaded beside the engine's own (draft_registry.py) and the fallback (fallback.py).
`generate` and `stream` run one sequence; a server opens many and steps them together (open_sequence, prefill,
step, close_sequence), every draft verified in one target pass. The engine keeps no per-sequence state of its own.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from draftwise.acceptance_pools import AcceptancePools
from draftwise.backends.base import SharedBackend
from draftwise.backends.prefix_cache import PrefixCache
from draftwise.catch_up import CatchUp
from draftwise.config import GenerationConfig
from draftwise.draft_lengths import DraftLengths
from draftwise.draft_registry import DraftRegistry
from draftwise.estimates import DRAFT_ESTIMATE
from draftwise.fallback import Fallback
from draftwise.grammar import GrammarCompiler
from draftwise.lifecycle import Sequences
from draftwise.metrics import Stats
from draftwise.proposers.base import Proposer
from draftwise.proposers.proposal_cache import ProposalCache
from draftwise.round import Round, RoundHooks, StepTimes
from draftwise.sequence import Sequence
from draftwise.text_caches import TextCaches
from draftwise.tokenizers import encode_prompt, readable_ids
from draftwise.types import Event

__all__ = ["Engine", "Result", "StepTimes"]


@dataclass(frozen=True)
class Result:
    text: str
    token_ids: list[int]
    stats: Stats
    finish_reason: str


class _Kept:
    """An engine setting kept by one of its parts, read and set on the engine (the server sets these after
    construction)."""

    def __init__(self, part: str, name: str):
        self.part, self.name = part, name

    def __get__(self, engine, owner=None):
        return self if engine is None else getattr(getattr(engine, self.part), self.name)

    def __set__(self, engine, value) -> None:
        setattr(getattr(engine, self.part), self.name, value)


class Engine:
    # The server's proposal log and feature capture (round.RoundHooks).
    round_observer = _Kept("hooks", "round_observer")
    feature_sink = _Kept("hooks", "feature_sink")
    # The server's fallback: a proposer that raises (or, with draft_timeout_s, drafts too slowly) is dropped and
    # its sequence goes on with the target alone, still exact. Off, a proposer's error ends the request.
    fall_back_on_proposer_error = _Kept("fallback", "on_proposer_error")
    draft_timeout_s = _Kept("fallback", "draft_timeout_s")
    # How the engine makes another draft (loading.draft_maker), and the loaded one in front (promote_draft).
    draft_maker = _Kept("drafts", "maker")
    draft_in_front = _Kept("drafts", "in_front")
    open_sequences = _Kept("catch_up", "open_sequences")  # sequences open now
    eos = _Kept("round", "eos")  # the ids that end a text
    last_step = _Kept("round", "last_step")  # where the last step's seconds went (StepTimes)
    draft_policy = _Kept("lengths", "policy")  # the last step's drafter's draft-length policy

    def __init__(self, target: SharedBackend, tokenizer, proposer: Proposer | None, method: str, eos: frozenset[int],
                 max_context: int | None = None, speed_paths: dict | None = None):
        """speed_paths: which speed paths were chosen at load (dtype, kernels, draft vocabulary), for the stats.
        max_context: the smallest context of the models involved (the target's by default)."""
        self.target, self.tokenizer, self.method = target, tokenizer, method
        self.max_context = max_context or target.max_context
        self.readable_ids = readable_ids(tokenizer, target.embedding_rows)  # the ids a prompt of token ids may hold
        # Structured output's matchers (llguidance's view of the tokenizer is built at the first grammar).
        self.grammars = GrammarCompiler(tokenizer, max(target.embedding_rows, len(tokenizer)), eos)
        self.speed_paths = dict(speed_paths or {})
        self.hooks, self.fallback = RoundHooks(), Fallback(proposer)
        self.lengths, self.pools = DraftLengths(method), AcceptancePools()
        self.caches, self.drafts = TextCaches(), DraftRegistry()
        self.catch_up = CatchUp(self.lengths, self.fallback)
        self.round = Round(target, self.max_context, eos, self.lengths, self.fallback, self.hooks)
        self.sequences = Sequences(target, tokenizer, proposer, method, self.max_context, self.readable_ids,
                                   self.grammars, self.speed_paths, self.drafts, self.caches, self.pools,
                                   self.lengths, self.catch_up, self.hooks)

    @property
    def proposer(self) -> Proposer | None:
        """The engine's own proposer: it serves the first live sequence, and the others get forks of it."""
        return self.sequences.proposer

    @proposer.setter
    def proposer(self, proposer: Proposer | None) -> None:
        self.sequences.proposer = self.fallback.own_proposer = proposer

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

    # -- what it serves --------------------------------------------------------------------------------------
    @property
    def methods_available(self) -> tuple[str, ...]:
        """The methods a sequence may ask for (lifecycle.Sequences.methods_available)."""
        return self.sequences.methods_available

    @property
    def drafts_available(self) -> tuple[str, ...]:
        """The draft models a sequence may name (GenerationConfig.draft) beside the engine's own."""
        return tuple(self.drafts.drafts)

    def add_draft(self, name: str, draft_model) -> None:
        """Load draft_model (floats, sharing the target's tokenizer) beside the engine's own draft, on the same kernels,
        for sequences that name it: a candidate's trial. The output stays the target's whatever the draft."""
        self.drafts.add(name, draft_model, self.tokenizer, self.target.embedding_rows, self.max_context, self.caches)

    def remove_draft(self, name: str) -> None:
        """Sequences open on it go on with it to their end; new ones can no longer name it."""
        self.drafts.remove(name)

    def promote_draft(self, name: str | None) -> None:
        """Put a loaded draft in front: the draft-model methods draft with it unless a sequence names another (None:
        the engine's own again). Open sequences finish on the draft they started with."""
        self.drafts.promote(name)

    # -- one sequence ----------------------------------------------------------------------------------------
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
        seq.fills_before_probes = True  # decoding alone: its lagging draft is filled before each probe
        try:
            while not seq.prefill_done:
                self.prefill(seq)
            # Alone, there is no batch to spare the draft's prefill for; it is prefill too (on a long prompt the draft
            # model's prefill costs seconds, which decode's tokens/s would otherwise hide).
            seq.stats.prefill_s += self.catch_up.timed_fill(seq)
            while seq.finish is None:
                if self.wants_catch_up(seq):
                    seq.stats.decode_s += self.catch_up.timed_fill(seq)  # drafting's work, while decoding
                events = self.step([seq])[seq]
                if seq.finish == "error":
                    raise seq.exception
                yield from events
        finally:
            self.close_sequence(seq)

    # -- many sequences: what a scheduler calls ---------------------------------------------------------------
    def check_open(self, prompt_ids: list[int], cfg: GenerationConfig) -> str:
        """The method a sequence of these options would run, once its method and limits are checked."""
        return self.sequences.check_open(prompt_ids, cfg)

    def check_limits(self, prompt_len: int, cfg: GenerationConfig) -> None:
        """Raise DraftwiseError when the request cannot fit the context (before anything is allocated)."""
        self.sequences.check_limits(prompt_len, cfg)

    def open_sequence(self, prompt_ids: list[int], cfg: GenerationConfig) -> Sequence:
        """A live sequence with its own cache slots and proposer; checked before anything is allocated."""
        return self.sequences.open(prompt_ids, cfg)

    def prefill(self, seq: Sequence, max_tokens: int | None = None) -> None:
        """Put (up to max_tokens more of) the prompt into the caches; a server prefills in chunks so a long prompt
        does not stall the sequences already decoding."""
        self.sequences.prefill(seq, max_tokens)

    def step(self, seqs: list[Sequence]) -> dict[Sequence, list[Event]]:
        """One round for every sequence (round.Round.step): each sequence's events."""
        self.catch_up.observe_step(len(seqs))
        return self.round.step(seqs)

    def close_sequence(self, seq: Sequence) -> None:
        """Give the sequence's slots back (once); what it learnt is pooled and its caches offered."""
        self.sequences.close(seq)

    def wants_catch_up(self, seq: Sequence) -> bool:
        """Whether to fill the sequence's lagging draft now (catch_up.CatchUp.wants)."""
        return self.catch_up.wants(seq)

    def catch_up_draft(self, seq: Sequence, max_tokens: int | None = None) -> None:
        """Feed (up to max_tokens of) the text the sequence's draft cache lacks, all but the last token."""
        self.catch_up.fill(seq, max_tokens)

    @property
    def catch_up_rows(self) -> float:
        """The batch a lagging draft's filling is priced at (catch_up.CatchUp.rows)."""
        return self.catch_up.rows

    def recent_acceptance(self, method: str, greedy: bool, estimate: str = DRAFT_ESTIMATE) -> float | None:
        """The per-token acceptance of this engine's earlier adaptive sequences of this method, greedy or sampled,
        the latest weighing most; None before any drafted (acceptance_pools.AcceptancePools.recent)."""
        return self.pools.recent(method, greedy, estimate)

    # -- the caches ------------------------------------------------------------------------------------------
    def enable_prompt_cache(self, max_bytes: int) -> PrefixCache:
        """Reuse the keys and values of earlier texts for prompts that start the same way, in the target and in
        the draft model (one byte budget for both; see backends/prefix_cache.py)."""
        return self.caches.enable_prompt_cache(self.target, self.proposer, max_bytes)

    def enable_proposal_cache(self, max_tokens: int) -> ProposalCache:
        """Let prompt lookup propose from the texts of earlier sequences too, the last max_tokens tokens of them."""
        return self.caches.enable_proposal_cache(self.proposer, max_tokens)

    @property
    def prompt_cache(self) -> PrefixCache | None:
        return self.caches.prompt

    @property
    def proposal_cache(self) -> ProposalCache | None:
        return self.caches.proposals
