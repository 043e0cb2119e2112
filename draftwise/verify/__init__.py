"""Who judges a draft: pure functions over token ids and probabilities, no model calls."""
from draftwise.verify.greedy import verify_greedy
from draftwise.verify.rejection import verify_rejection

__all__ = ["verify_greedy", "verify_rejection"]
