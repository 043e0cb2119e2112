"""Hybrid: each round, prompt lookup proposes when the text's tail has a long enough earlier match; the draft
model proposes otherwise.

Lookup is free and strong where the output copies the input (summaries, code edits, RAG); the draft model
covers the free text in between. This wraps the two proposers as they are; it only picks one per round.

Cache rule: observe() goes only to the proposer that made the last proposal, because the draft model's
observe() cuts its cache relative to the context of *its* last propose. While lookup proposes, the draft
model's cache stays where it was (a shorter prefix of the text); its next propose feeds every context token it
has not cached, in one forward, so it catches up on its own. (hybrid-skip's draft has no cache of its own: it
drafts in the sequence's target slot, which the engine keeps at the text, so it never lags.)

Exactness: the choice depends on the context alone, and the verifier handles both kinds of draft per round
(a lookup draft is one-hot, Draft.q None; a draft-model draft carries q under sampling).

hybrid-tree pairs the two tree proposers (lookup-tree, draft-tree) the same way. A draft-tree round leaves its
tree in the draft's cache, so keep_path() goes to the draft model only after a round it made. The two share
one tree sizing (how many nodes a round offers, by the measured costs), which the engine prices once (price_with).
Once those costs are measured, and the sequence's rounds may follow them (not a fixed k: `--fixed-k`, or a
seeded sampled request), either hybrid picks by measurement instead of by MIN_NGRAM: lookup wins a round when its
guess is expected to give more tokens per second than the draft model's, each priced by the measured pass and
draft forward, and each judged by its own per-token acceptance in this sequence. Lookup keeps its own per length
of the match it found, learnt every round for free (prompt_lookup.py): its guess is made every round, and the
tokens the target emits next say how much of it would have been kept.
A match shorter than MIN_NGRAM starts pessimistic, so that it wins only on that evidence (the chain's lookup
offers none: its guesses follow matches of MIN_NGRAM tokens). Each of these estimates starts from what the
engine's earlier sequences of the method kept (acceptances, start_acceptances; Acceptance.start_from): carried
for the draft model's alone, a new request's first rounds would go to it where lookup's, at its default, would
have won them. The choice still depends on the past
alone, as the draft length does (adaptive.py), so the output stays exact.

hybrid-skip pairs the target's own draft (layer_skip.py: int8 copies of its layers, some maybe skipped) with lookup
as the chain hybrid does: no second model, and lookup takes the rounds where the text copies itself.

hybrid-head pairs a trained feature head's trees (feature_head.py) with lookup-tree the same way: no draft model,
and lookup covers what the head is weakest at, text that copies its prompt (summaries, where lookup keeps several
times more of its guesses than the head). The head keeps no cache of the text and has no steps to share in a batch:
it drafts at once, and while lookup wins rounds the verified text's features still reach it (add_features), so its
next round catches up on them (within its window).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from draftwise import planner
from draftwise.estimates import DRAFT_ESTIMATE, Acceptance, StepCosts
from draftwise.config import DEFAULT_LOOKUP_NGRAM, SamplingConfig
from draftwise.proposers.base import Proposer
from draftwise.proposers.prompt_lookup import TRUSTED_NGRAM, PromptLookupProposer
from draftwise.proposers.proposal_cache import ProposalCache
from draftwise.proposers.tree_growth import followed_costs
from draftwise.types import Draft

# Lookup replaces the draft model only on evidence of copying: a match of the text's last MIN_NGRAM tokens (lookup's
# trusted length: what followed a shorter shared tail elsewhere is mostly wrong here, where the draft model is
# usually right).
MIN_NGRAM = TRUSTED_NGRAM
# A lookup guess of one token (the match ends right before the tail, as in a loop) keeps at most one token,
# where the draft model's could keep k: it wins only when k is 1.
MIN_LOOKUP_TOKENS = 2


class HybridProposer(Proposer):
    def __init__(self, draft: Proposer, lookup: PromptLookupProposer, min_ngram: int | None = None):
        """draft: the proposer of the rounds that cost forwards (a draft model's, a head's, the skip draft's).
        min_ngram: the shortest match that wins a round by rule (see MIN_NGRAM); default lookup's own."""
        self.draft = draft
        self.lookup = lookup
        # The draft's, and lookup's free guesses and estimates; always in steps (a lookup round is ready at once,
        # and a draft without steps drafts at start()).
        self.capabilities = replace(draft.capabilities, guesses_free=True, judges_rounds=False, keeps_estimates=True,
                                    drafts_in_steps=True,
                                    drafts_trees=draft.capabilities.drafts_trees or lookup.capabilities.drafts_trees)
        self.min_ngram = lookup.min_ngram if min_ngram is None else min_ngram
        lookup.trusted_ngram = self.min_ngram  # shorter matches start pessimistic (lookup's acceptance by match)
        # The draft model's per-token acceptance (the draft length follows it); lookup keeps its own by match length.
        self._draft_acceptance = Acceptance()
        self._drafted_depth: int | None = None  # the last round's draft-model draft, until observed
        if draft.sizing is not None and lookup.sizing is not None:
            lookup.sizing = draft.sizing  # one tree sizing for the pair, priced once
        self._last: Proposer | None = None  # made the last proposal
        self.rounds = {"lookup": 0, "draft": 0}  # proposals of each, this sequence
        self._guess: Draft | None = None  # this round's lookup guess, when lookup won it
        self._drafting = False  # whether this round's draft was started (and so has something to settle)
        self.lookup_round = False  # whether lookup made the last proposal (drafted_free)
        self._armed: Draft | None = None  # lookup's guess for a round the engine gave it alone (free_round)
        # The engine's step costs (price_with), which price the chain's pick, its lookup's guess and free rounds;
        # None for a fixed k, whose rounds must not follow timings.
        self.costs: StepCosts | None = None
        self._free_depth = 0  # the deepest guess lookup may offer, a free round's k (prepare_round, each round)
        self._rows = 1  # the rows of this round's step, which its pick is priced in (prepare_round, each round)

    def price_with(self, costs: StepCosts, follow: bool) -> None:
        """Both parts are priced by them (a tree pair's one sizing, the draft's and lookup's alike). The chain's
        lookup sizes its guess by them as lookup alone does: offered as deep as it pays, it is judged at the rate
        of its best depth, not of its full k."""
        self.costs = costs if follow else None
        self.draft.price_with(costs, follow)
        self.lookup.price_with(costs, follow)

    def prepare_round(self, depth: int, rows: int = 1) -> None:
        self._free_depth, self._rows = depth, rows
        self.draft.prepare_round(depth, rows)
        self.lookup.prepare_round(depth, rows)

    def attach_prompt_cache(self, cache) -> None:
        self.draft.attach_prompt_cache(cache)

    def follow_grammar(self, guide) -> None:
        self.draft.follow_grammar(guide)  # (lookup's guesses are the text's own: the engine cuts them)

    def share_noise(self, noise) -> None:
        self.draft.share_noise(noise)  # (lookup guesses what the text says, not what the noise does)

    def attach_corpus(self, corpus: ProposalCache) -> None:
        self.lookup.attach_corpus(corpus)

    def fork_drafter(self) -> Proposer:
        return self.draft.fork()

    def fork_on_draft_model(self, proposer_cls: type) -> Proposer:
        return self.draft.fork_on_draft_model(proposer_cls)

    @property
    def feature_layers(self) -> tuple[int, ...]:  # a head's
        return self.draft.feature_layers

    @property
    def speed_paths(self):  # a head's
        return self.draft.speed_paths

    def begin(self, prompt_ids: list[int], sampling: SamplingConfig, generator: torch.Generator) -> None:
        self.draft.begin(prompt_ids, sampling, generator)
        self.lookup.begin(prompt_ids, sampling, generator)
        self._last = None
        self.rounds = {"lookup": 0, "draft": 0}
        self._draft_acceptance = Acceptance()
        # Nothing of a round the last sequence left unfinished (a step that raised between free_round and propose).
        self._armed, self._guess, self._drafted_depth, self.lookup_round = None, None, None, False
        self._drafting = False

    def acceptances(self) -> dict[str, Acceptance]:
        """This sequence's acceptance estimates by name, what the engine carries to the next sequence of the method:
        the draft model's, and lookup's after each length of match."""
        return {DRAFT_ESTIMATE: self._draft_acceptance, **self.lookup.acceptances()}

    def start_acceptances(self, rates: dict[str, float]) -> None:
        """Start each estimate from what the engine's earlier sequences kept (by the names acceptances() gives);
        lookup's are made as its matches first occur, and start then."""
        self._draft_acceptance.start_from(rates.get(DRAFT_ESTIMATE))
        self.lookup.start_acceptances(rates)

    @property
    def sizing(self):  # the pair's tree sizing (tree_growth.py); None for the chain hybrid
        return self.draft.sizing

    def bind(self, target_slot) -> None:
        """Where the draft drafts in the sequence's own target slot (skip), it binds to it. Lookup's rounds leave
        that slot as the engine keeps it: the text but its last token, which is all the skip draft reads, so it
        never lags behind."""
        self.draft.bind(target_slot)

    def add_features(self, start: int, features) -> None:
        self.draft.add_features(start, features)  # (every round's, lookup's too: the head catches up on them)

    def propose(self, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
        guess = self._pick(context, k)
        return guess if guess is not None else self._drafted(self.draft.propose(context, k, stop_confidence))

    def _drafted(self, draft: Draft) -> Draft:
        self._drafted_depth = draft.depth  # (it may stop short of k)
        return draft

    def _pick(self, context: list[int], k: int) -> Draft | None:
        """Lookup's guess when it wins the round, else None (the draft model's round)."""
        # Lookup takes the full k: it costs nothing, so no confidence cut applies to it.
        self._last, self._drafted_depth = self.lookup, None
        armed, self._armed = self._armed, None
        if armed is not None:  # made and judged by free_round for this very round
            self.lookup_round = True
            self.rounds["lookup"] += 1
            return armed
        guess = self.lookup.propose(context, self._lookup_k(k))  # (judged next round, won or not)
        self.lookup_round = guess.depth > 0 and self._lookup_wins(guess, self.lookup.last_match, k)
        if self.lookup_round:
            self.rounds["lookup"] += 1
            return guess
        self._last = self.draft  # set before proposing: a failed propose is still observed (with 0)
        self.rounds["draft"] += 1
        return None

    def _lookup_k(self, k: int) -> int:
        """How deep lookup may guess in a round whose draft-model k is k. The tree hybrid's lookup sizes its own
        tree by the measured cost of the wider pass, and costs no forward: it goes as deep as in a round the draft
        model sits out. Cut to the draft model's k, it would lose rounds on copying text: while the policy keeps
        the draft model shallow, lookup's free guesses would be cut as short, and the hybrid would need more
        target passes than lookup-tree alone. The chain's lookup does the same once its pick is measured, which
        prices the guess's width (by rule it is not: k). A fixed-k sequence keeps k."""
        sizing = self.sizing
        priced = sizing.by_cost if sizing is not None else self._measured() is not None
        return max(k, self._free_depth) if priced else k

    @property
    def drafting_acceptance(self) -> Acceptance:
        """The acceptance the engine's draft length follows, instead of the sequence's as a whole: the draft-model
        rounds alone. k prices the draft model's forwards; lookup rounds cost none, and in free text they are won
        on a lower acceptance (by rule, on any three-token match), which would pull the draft model's depth down
        below what `draft` alone runs, and the hybrid below `draft`'s speed."""
        return self._draft_acceptance

    @property
    def drafted_free(self) -> bool:
        """Whether the last round ran no draft forward (a lookup round, chain or tree): the engine then does not
        fold its near-zero drafting time into the draft model's cost per forward, which would make drafting look
        cheap and deepen the draft model's next rounds."""
        return self.lookup_round

    def free_round(self, context: list[int], k: int, rows: int = 1) -> int:
        """The engine's k for a round the draft model sits out (its policy found that draft forwards do not pay,
        or the draft is far behind its text), or 0. Lookup's guess costs no forward, so it may pay where the
        draft model's does not: in code that copies its prompt, with a draft model that is slow or wrong on this
        machine, a policy that priced every round by draft forwards would shut lookup out with it. Returns k, and
        arms the round for lookup alone, when the guess's expected tokens per second beat a plain step's in a
        pass of `rows` rows (the others emitting one token each); judged on the past alone, so still exact. Both
        hybrids: the chain's k follows its draft-model rounds too, so without these rounds, where the draft model
        does not pay (float32 on a CPU without BF16), its lookup would be shut out with it."""
        self._armed = None
        costs = self._followed_costs()
        if costs is None or k < 1:
            return 0
        guess = self.lookup.propose(context, k)  # (judged next round, offered or not)
        if guess.depth == 0:
            return 0
        free = planner.Offer(self.lookup.last_expected, len(guess))  # no draft forward
        if planner.rate(costs, rows, [free]) <= planner.rate(costs, rows):  # against a plain step
            return 0
        self._armed = guess  # the engine proposes with this k next: _pick hands it over without a second search
        return k

    def _followed_costs(self) -> StepCosts | None:
        """The measured step costs that price a free round (and, with a draft forward's time, a pick), where this
        sequence may follow them (not a fixed k, whose draws a seed must reproduce), else None."""
        return followed_costs(self.sizing, self.costs)  # (the tree hybrid's: its sizing's)

    def _measured(self) -> tuple[float | None, StepCosts] | None:
        """Seconds per draft-model forward (None: the step costs' own timing of a round's forwards) and the step
        costs that price a round's pick, once both are measured and the sequence follows them; else None: by rule.
        The tree hybrid's sizing times its own forwards; the chain's are the engine's (none until one is timed)."""
        costs = self._followed_costs()
        if costs is None:
            return None
        if self.sizing is None:  # (the engine's timing of a round's forwards prices the chain: forward_s None)
            return (None, costs) if costs.draft(self._rows) else None
        forward_s = self.sizing.forward_s
        return None if forward_s is None else (forward_s, costs)

    def _lookup_wins(self, guess: Draft, match: int, k: int) -> bool:
        measured = self._measured()
        if measured is None:
            # By rule (depth: a tree of siblings still guesses one token).
            return match >= self.min_ngram and guess.depth >= min(MIN_LOOKUP_TOKENS, k)
        # In the step's rows, the others taking a token each, as a free round is priced: a guess several tokens wide
        # that wins alone can lose beside other rows, whose pass it widens with it, since a wide pass costs more the
        # more rows it carries (docs/experiments/constants/README.md; docs/experiments/throttle-zen4, section 3).
        forward_s, costs = measured
        free = planner.Offer(self.lookup.last_expected, len(guess))  # no draft forward
        drafted = planner.Offer.of_chain(self._draft_acceptance.rate, k)
        return planner.rate(costs, self._rows, [free]) >= planner.rate(costs, self._rows, [drafted], forward_s)

    def keep_path(self, path: list[int]) -> None:
        """After verification, before observe(): a draft-tree round's kept path stays in the draft's cache."""
        if self._last is self.draft:
            self.draft.keep_path(path)

    def observe(self, num_accepted: int) -> None:
        if self._drafted_depth is not None:
            self._draft_acceptance.observe(self._drafted_depth, num_accepted)
            self._drafted_depth = None
        if self._last is not None:
            self._last.observe(num_accepted)
        self._last = None

    # The round in steps (see DraftModelProposer.start): lookup's guess is complete at once.
    def start(self, context: list[int], k: int, stop_confidence: float = 0.0) -> None:
        # Nothing of the last round may be settled again if this one fails early: a skip draft's settle() trims
        # the sequence's own target slot to where its last round started.
        self._guess, self._drafting = None, False
        self._guess = self._pick(context, k)
        if self._guess is not None:
            return
        if self.draft.capabilities.drafts_in_steps:
            self.draft.start(context, k, stop_confidence)
            self._drafting = True
        else:  # a proposer without steps (the head): its draft is ready at once, and nothing is left to settle
            self._guess = self._drafted(self.draft.propose(context, k, stop_confidence))

    def pending(self) -> list[int] | None:
        return None if self._guess is not None else self.draft.pending()

    def pending_layout(self):
        return None if self._guess is not None else self.draft.pending_layout()

    def time_forward(self, seconds: float) -> None:  # (only a draft-model round has forwards to time)
        self.draft.time_forward(seconds)

    @property
    def backend(self):  # where pending() tokens go
        return self.draft.backend

    def take(self, logits) -> None:
        self.draft.take(logits)

    def settle(self) -> None:
        if self._drafting:  # (a lookup round, or a head's draft made at once, left nothing to settle)
            self.draft.settle()
        self._drafting = False

    def finish(self) -> Draft:
        return self._guess if self._guess is not None else self._drafted(self.draft.finish())

    # The draft model's cache of the text (keeps_cache is the draft's: a head or the skip draft keeps none), and
    # what the draft keeps of a text in the prompt cache (a draft model's cache, a head's features).
    def extend(self, token_ids: list[int]) -> None:
        self.draft.extend(token_ids)

    def behind(self, context: list[int]) -> int:
        return self.draft.behind(context)

    def restore(self, token_ids: list[int]) -> int:
        return self.draft.restore(token_ids)

    def remember(self, text: list[int]) -> None:
        self.draft.remember(text)

    def fork(self) -> "HybridProposer":
        return HybridProposer(self.draft.fork(), self.lookup.fork(), self.min_ngram)

    def release(self) -> None:
        self.draft.release()


def hybrid_of(draft, branches: int, max_ngram: int = DEFAULT_LOOKUP_NGRAM, min_ngram: int | None = None,
              corpus: ProposalCache | None = None) -> HybridProposer:
    """The hybrid of a draft-model proposer and prompt lookup merging `branches` matches (1: a chain). min_ngram: the
    shortest match that wins a round by rule (default MIN_NGRAM, at most max_ngram). The tree hybrid's lookup
    offers every match (its rounds are picked by measurement once there is one); the chain hybrid's only matches
    of min_ngram tokens or more, by rule or measured."""
    min_ngram = min(MIN_NGRAM, max_ngram) if min_ngram is None else min_ngram
    lookup = PromptLookupProposer(max_ngram, 1 if branches > 1 else min_ngram, corpus, branches)
    return HybridProposer(draft, lookup, min_ngram)
