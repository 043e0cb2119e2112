"""Who guesses: one module per proposer, all behind the Proposer protocol."""
from draftwise.proposers.base import Proposer
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.hybrid import HybridProposer
from draftwise.proposers.prompt_lookup import PromptLookupProposer

__all__ = ["Proposer", "DraftModelProposer", "HybridProposer", "PromptLookupProposer"]
