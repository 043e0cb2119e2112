"""A model behind two small protocols: a shared model that sequences open slots of, and one sequence's slot
(prefill, forward new tokens, trim the cache).

Implementations live in their own modules (hf.py: Hugging Face transformers), imported where used,
so that importing the protocol does not import transformers.
"""
from draftwise.backends.base import Backend, SharedBackend

__all__ = ["Backend", "SharedBackend"]
