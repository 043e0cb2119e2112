"""What an engine keeps of earlier texts: the prompt cache (for prompts that start the same way: their keys and
values, in the target and in the draft model, and the target's features that a head drafts from) and the proposal
cache (their tokens, for prompt lookup to propose from). Both are off until a caller turns them on."""
from __future__ import annotations

from draftwise.backends.prefix_cache import PrefixCache
from draftwise.proposers.base import Proposer
from draftwise.proposers.proposal_cache import ProposalCache
from draftwise.sequence import Sequence


class TextCaches:
    def __init__(self):
        self.prompt: PrefixCache | None = None
        self.proposals: ProposalCache | None = None

    def enable_prompt_cache(self, target, proposer: Proposer | None, max_bytes: int) -> PrefixCache:
        """One byte budget for the target's and the draft model's entries (see backends/prefix_cache.py)."""
        self.prompt = PrefixCache(max_bytes)
        if target.capabilities.prompt_cache:
            target.attach_prompt_cache(self.prompt, "target")
        if proposer is not None:  # (a draft model's cache, a head's features, a hybrid's part's)
            proposer.attach_prompt_cache(self.prompt)
        return self.prompt

    def enable_proposal_cache(self, proposer: Proposer | None, max_tokens: int) -> ProposalCache:
        """Let prompt lookup (lookup, lookup-tree and every hybrid's lookup rounds) propose from the last max_tokens
        tokens of earlier sequences' texts too (see proposers/proposal_cache.py)."""
        self.proposals = ProposalCache(max_tokens)
        if proposer is not None:  # (lookup's, a hybrid's lookup's; the sequences' own get it as they open)
            proposer.attach_corpus(self.proposals)
        return self.proposals

    def attach_draft(self, backend, name: str) -> None:
        """A draft loaded beside the engine's own keeps its prompts' keys and values as the engine's own draft's."""
        if self.prompt is not None and backend.capabilities.prompt_cache:
            backend.attach_prompt_cache(self.prompt, f"draft@{name}")

    def restore(self, target, proposer: Proposer | None, prompt_ids: list[int]) -> int:
        """How much of the prompt (of all but its last token) the target got from the prompt cache; the proposer
        gets what the cache holds of that prefix for it (a draft model's cache, a head's features). Chunked prefill
        (and the draft's catch-up) does the rest."""
        if self.prompt is None:
            return 0
        reused = target.restore(prompt_ids[:-1])
        if reused and proposer is not None:
            proposer.restore(prompt_ids[:reused])
        return reused

    def remember(self, seq: Sequence) -> None:
        """Offer a leaving sequence's caches to the prompt cache (they hold its text but the last token), and its
        finished text to the proposal cache."""
        if self.prompt is not None and seq.finish != "error":
            seq.target.remember(seq.context[:-1])
            if seq.proposer is not None:
                seq.proposer.remember(seq.context[:-1])
        if self.proposals is not None and seq.finish not in (None, "error"):
            self.proposals.add(seq.context)

