"""A model behind one checked contract: a shared model that sequences open slots of, and one sequence's slot
(prefill, forward new tokens, trim the cache), with what each backend can do declared as data (base.py,
capabilities.py).

Implementations live in their own modules (hf.py: Hugging Face transformers; quant.py: its linears on a GGUF
file's blocks; llamacpp.py: llama.cpp; skipping.py: the target with layers skipped), imported where used, so that
importing the contract does not import transformers.
"""
from draftwise.backends.base import Backend, SharedBackend
from draftwise.backends.capabilities import BackendCapabilities

__all__ = ["Backend", "BackendCapabilities", "SharedBackend"]
