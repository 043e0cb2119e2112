"""Who guesses: one module per proposer, all deriving from the Proposer contract (base.py)."""
from draftwise.proposers.base import Capabilities, Proposer
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.hybrid import HybridProposer
from draftwise.proposers.prompt_lookup import PromptLookupProposer

__all__ = ["Capabilities", "Proposer", "DraftModelProposer", "HybridProposer", "PromptLookupProposer"]
