"""The proposer contract: every member the engine (and the server through it), the batch of draft forwards
(batch.py) and loading may use.

A proposer guesses the tokens that follow a sequence's text; the target verifies them, so nothing here can change
the output, only how fast it comes. One Proposer serves one live sequence at a time (fork() makes another).

Required: begin, propose, observe, fork. Everything else has a default that does nothing (or answers "none"), so a
proposer implements only what it has. What it has is declared once, as data (Capabilities): the engine branches on
those declarations, never on which attributes an object happens to have.

A sequence's life, as the engine drives it (engine.py):

    open     bind(target slot), begin(prompt, sampling, generator), follow_grammar(guide or None), restore(prompt
             prefix) where the prompt cache had it, price_with(costs, follow), start_acceptances(rates)
             (keeps_estimates)
    prefill  add_features(...) of the prompt (reads_target_features); extend(...) while behind(text) (keeps_cache)
    a round  free_round(...) where it guesses free and the engine's k leaves it the round, prepare_round(d, rows);
             then propose(...) or, sharing draft forwards with other sequences, start / pending / pending_layout /
             take / time_forward / settle / finish; after the target pass: add_features(kept rows),
             keep_path(kept path), observe(kept count); drafted_free says whether it ran a draft forward
    close    acceptances() carried to the next sequence of the method (start_acceptances), remember(text) offered
             to the prompt cache, release()
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from draftwise.config import SamplingConfig
from draftwise.errors import DraftwiseError
from draftwise.types import Draft

if TYPE_CHECKING:  # (annotations only: the estimates and backends need nothing of this module)
    from draftwise.backends.prefix_cache import PrefixCache
    from draftwise.estimates import Acceptance, StepCosts
    from draftwise.grammar import DraftGuide
    from draftwise.proposers.proposal_cache import ProposalCache
    from draftwise.proposers.tree_growth import TreeSizing
    from draftwise.shared_noise import SharedNoise
    from draftwise.types import TreeLayout


@dataclass(frozen=True)
class Capabilities:
    """What a proposer does, declared by its class (or, for a proposer built of parts, at construction)."""

    needs_draft_model: bool = False  # drafts with a second model, loaded beside the target
    drafts_trees: bool = False  # its drafts may be token trees (Draft.parents), not only chains
    # Drafts in steps (start, pending, pending_layout, take, time_forward, settle, finish; `backend`), so that many
    # sequences' draft forwards share one batched forward (batch.py). Without it, the batch just calls propose().
    drafts_in_steps: bool = False
    takes_rows: bool = False  # in steps, take() reads every fed row's logits (a tree's depth), not the last one's
    guesses_free: bool = False  # has a guess that costs no draft forward, offered by free_round (prompt lookup)
    # Decides every round itself, after its free guess (free_round), instead of drafting the engine's shared k,
    # which is priced by draft forwards and learnt on drafted rounds (the methods lookup and lookup-tree).
    judges_rounds: bool = False
    # Keeps its own cache of the text, which the engine fills (extend, while behind); the prompt cache's part
    # (restore, remember) is every proposer's. A draft that drafts in the sequence's target slot keeps none.
    keeps_cache: bool = False
    reads_target_features: bool = False  # drafts from the target's hidden states, handed over by add_features
    # Keeps its own acceptance estimates by name (acceptances, start_acceptances), which the engine carries from
    # sequence to sequence; without, the engine carries the sequence's own acceptance.
    keeps_estimates: bool = False


class Proposer(ABC):
    """The base of every proposer. Subclasses set `capabilities` and implement the members those promise."""

    capabilities: Capabilities = Capabilities()
    # Where pending() tokens go, for a proposer that drafts in steps: its slot of a shared draft backend (a SlotView,
    # or the backend itself for its default slot). None for any other proposer.
    backend = None
    # The tree sizing of a proposer whose trees are sized by cost (tree_growth.py), else None. A hybrid shares one
    # between its parts; the engine does not touch it (its costs arrive through price_with).
    sizing: TreeSizing | None = None
    # What loading chose for the proposer's own speed (a head's folder, parameters, kernels), for the run's stats.
    speed_paths: Mapping = MappingProxyType({})
    # The target's decoder layers whose outputs add_features also carries (a fused head's), besides the last.
    feature_layers: tuple[int, ...] = ()

    # -- required ------------------------------------------------------------------------------------------
    @abstractmethod
    def begin(self, prompt_ids: list[int], sampling: SamplingConfig, generator: torch.Generator) -> None:
        """Start a new sequence (drop any state of the previous one). Called once per sequence, after bind()."""

    @abstractmethod
    def propose(self, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
        """Guess up to k tokens (a tree: k nodes) that follow context (prompt + everything emitted so far).

        A proposer that knows its confidence stops early once it falls below stop_confidence."""

    @abstractmethod
    def observe(self, num_accepted: int) -> None:
        """The target kept the first num_accepted tokens of the last draft (0 when the round failed).

        Called after every round the proposer drafted (k > 0), from the engine's `finally`: a proposer with a
        cache drops the rest here."""

    @abstractmethod
    def fork(self) -> Proposer:
        """A proposer of the same kind for another live sequence: shared weights, its own state and cache slot."""

    # -- the sequence -----------------------------------------------------------------------------------------
    def release(self) -> None:
        """The sequence is gone: give back what fork() allocated (a draft cache slot). Called once, on close."""

    def bind(self, target_slot) -> None:
        """The sequence's own slot of the target's cache, before begin(): a draft that drafts in it (layer
        skipping) binds to it."""

    def follow_grammar(self, guide: DraftGuide | None) -> None:
        """At open, after begin(): the sequence's grammar (grammar.py), None without one. A proposer that picks its
        guesses from its own logits may mask them with it so that they keep to the grammar; the engine cuts a guess
        that does not, and verifies under the grammar either way, so ignoring it costs only speed."""

    def share_noise(self, noise: SharedNoise | None) -> None:
        """At open, after begin(): a seeded sampled sequence's noise (shared_noise.py), None for any other. Its
        text is the target's draws from that noise, and begin() was given greedy sampling: the guesses are kept
        when they name those draws, so a proposer that picks its guesses from its own logits may run the same race
        on them (a draft model does); one that ignores it guesses greedily, exact either way."""

    def price_with(self, costs: StepCosts, follow: bool) -> None:
        """At open: the engine's step costs (measured as it runs, shared by every sequence), which price this
        proposer's rounds where it sizes them itself (a tree's width, lookup's depth, a hybrid's pick); follow:
        whether this sequence may follow them: one drafting a fixed k (adaptive off) drafts what it was told."""

    def attach_prompt_cache(self, cache: PrefixCache) -> None:
        """The engine's prompt cache, for the draft model's cache of texts (one byte budget with the target's)."""

    def attach_corpus(self, corpus: ProposalCache) -> None:
        """The engine's proposal cache: earlier requests' texts, for prompt lookup's guesses."""

    # -- forks for another method -------------------------------------------------------------------------------
    def fork_drafter(self) -> Proposer:
        """A fork of what drafts this proposer's rounds that cost forwards: itself, or a hybrid's draft part (its
        draft model's, head's or skip draft's proposer). For a sequence asking for that part's method alone."""
        return self.fork()

    def fork_on_draft_model(self, proposer_cls: type) -> Proposer:
        """A proposer of class proposer_cls (a draft-model proposer: chain or tree) on a new slot of the draft model
        this one drafts with; for a sequence asking for another of the draft model's methods."""
        raise DraftwiseError(f"{type(self).__name__} drafts with no draft model")

    # -- the draft's own cache of the text (keeps_cache) ------------------------------------------------------
    def extend(self, token_ids: list[int]) -> None:
        """Prefill: append text its cache does not hold yet (no logits needed)."""

    def behind(self, context: list[int]) -> int:
        """Tokens of the text (but its last, which every round feeds) that its cache lacks; 0 without a cache."""
        return 0

    # -- what it keeps of a text in the prompt cache: a draft model's cache (keeps_cache), a head's features ----
    def restore(self, token_ids: list[int]) -> int:
        """At open, where the prompt cache gave the target this prefix of the prompt: take what the prompt cache
        holds of that prefix for this proposer too; returns how many of token_ids it now has (the engine prefills
        the rest)."""
        return 0

    def remember(self, text: list[int]) -> None:
        """At close: offer what it holds of the text (all but its last token, as the target offers) to the prompt
        cache."""

    # -- the target's features (reads_target_features) ---------------------------------------------------------
    def add_features(self, start: int, features: torch.Tensor) -> None:
        """The target's features [n, H] at text positions start, start + 1, ...: from prefill, and after each
        round the verified rows of the kept path."""

    # -- a round ----------------------------------------------------------------------------------------------
    def prepare_round(self, depth: int, rows: int = 1) -> None:
        """Each round, before propose: the deepest a guess that costs no forward may go (the sequence's
        num_draft_tokens, within what it may still emit), whatever k the engine gives the round; and the rows of the
        step, which a guess's width is priced in (a pass of many rows turns dear with width where one row's does
        not)."""

    def free_round(self, context: list[int], k: int, rows: int = 1) -> int:
        """guesses_free: the k for a round that runs no draft forward (the engine's policy found that forwards do
        not pay, the draft is far behind its text, or the proposer judges every round), at most k; 0 where its
        free guess does not beat a plain step in a pass of `rows` rows. Returning k > 0 arms the round: the next
        propose() hands that very guess over."""
        return 0

    @property
    def armed_nodes(self) -> int:
        """The nodes of the guess free_round armed for this round (0: none): its width in the pass."""
        return 0

    @property
    def drafted_free(self) -> bool:
        """Whether the last round ran no draft forward (a lookup guess). The engine then leaves it out of the
        seconds per draft forward, and out of the tree spread that its shared k prices."""
        return False

    def keep_path(self, path: list[int]) -> None:
        """After verification, before observe(): the kept nodes of the last draft (root's child first). A tree
        drafted in the proposer's own cache moves the kept path's entries into place there."""

    # -- a round in steps (drafts_in_steps; batch.py) -------------------------------------------------------------
    def start(self, context: list[int], k: int, stop_confidence: float = 0.0) -> None:
        """Begin a round in steps; then while pending() gives tokens: take(their logits); settle(); finish()."""
        raise NotImplementedError(f"{type(self).__name__} does not draft in steps")

    def pending(self) -> list[int] | None:
        """The tokens the next draft forward must feed (to `backend`), or None once the round's draft is made."""
        raise NotImplementedError(f"{type(self).__name__} does not draft in steps")

    def pending_layout(self) -> TreeLayout | None:
        """The tree of the pending feed (a tree proposer's depth: the backend's mask and positions); None: text."""
        return None

    def time_forward(self, seconds: float) -> None:
        """What the forward take() is about to read cost (in a batch, the shared forward's time)."""

    def take(self, logits: torch.Tensor) -> None:
        """The logits after the pending tokens: [draft_vocab] for the last one, or [fed, draft_vocab] (takes_rows)."""
        raise NotImplementedError(f"{type(self).__name__} does not draft in steps")

    def settle(self) -> None:
        """In `finally`, whatever happened in the round: the cache holds exactly the proposer's tokens."""

    def finish(self) -> Draft:
        """The round's draft, once pending() is None and settle() has run."""
        raise NotImplementedError(f"{type(self).__name__} does not draft in steps")

    # -- acceptance estimates (keeps_estimates) -------------------------------------------------------------------
    @property
    def drafting_acceptance(self) -> Acceptance | None:
        """The acceptance the engine's shared k follows, where the proposer keeps its own for the rounds that k
        prices (a hybrid's draft-model rounds); None: the sequence's."""
        return None

    def acceptances(self) -> dict[str, Acceptance]:
        """This sequence's estimates by name, which the engine carries to the next sequence of the method."""
        return {}

    def start_acceptances(self, rates: dict[str, float]) -> None:
        """At open: start each estimate from what the engine's earlier sequences of the method kept, by name."""
