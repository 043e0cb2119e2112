"""What a backend can do, declared as data on its class: the methods table (methods.py) reads it to say which
methods a backend serves, and the engine reads it instead of asking which class a backend is.

A backend asked for what it does not declare raises a DraftwiseError that says so (the conformance test,
tests/test_backend_contract.py, asks every backend for each undeclared feature)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendCapabilities:
    trees: bool = False  # forward_batch scores a token tree (trees=) and a slot's keep() moves its kept path
    hidden_states: bool = False  # forward_batch(hidden=True) returns the last hidden states (and feature_layers')
    layer_access: bool = False  # `model` is a torch module whose decoder layers may be swapped or passed over
    prompt_cache: bool = False  # attach_prompt_cache: its slots restore from and remember into a PrefixCache
    # A position's logits can be the same bits whatever call computed them (a step, a chain, a tree, a prefill
    # chunk, a row of a ragged batch): by construction, or on the kernels loading chooses (hf: the invariant one).
    batch_invariant: bool = False
    dtypes: tuple[str, ...] = ("float32",)  # the dtypes it computes in ("float32", "bfloat16")
