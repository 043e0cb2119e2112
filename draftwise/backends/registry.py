"""The backends a user chooses among (--backend), by name, in the order errors list them: where only a name is
known (a CLI choice, before anything loads), the methods table reads what the named class declares."""
from __future__ import annotations

from draftwise.backends.base import SharedBackend
from draftwise.backends.hf import HFBackend
from draftwise.backends.llamacpp import LlamaCppBackend
from draftwise.backends.quant import QuantBackend

BACKEND_CLASSES: dict[str, type[SharedBackend]] = {cls.backend_name: cls
                                                   for cls in (HFBackend, QuantBackend, LlamaCppBackend)}
