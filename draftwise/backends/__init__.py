"""A model behind one small protocol: prefill, forward new tokens, trim the cache."""
from draftwise.backends.base import Backend
from draftwise.backends.hf import HFBackend, load_hf

__all__ = ["Backend", "HFBackend", "load_hf"]
