"""A model behind one small protocol: prefill, forward new tokens, trim the cache.

Implementations live in their own modules (hf.py: Hugging Face transformers), imported where used,
so that importing the protocol does not import transformers.
"""
from draftwise.backends.base import Backend

__all__ = ["Backend"]
