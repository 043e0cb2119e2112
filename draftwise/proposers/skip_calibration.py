"""Which layers the `skip` method passes over, chosen on this machine for this model.

1. One full forward over a calibration text gives each layer's influence: how far it turns the residual
   stream, 1 - cos(input, output) averaged over the tokens (ShortGPT's block influence). Layers that barely
   turn it are the ones to skip first; the first layer is never skipped (it reads the raw embeddings), nor
   the last of four or more (it writes what the output layer reads).
2. For a few skip counts n (an eighth, a quarter, three eighths and half of the layers), the n least
   influential are skipped and the same text is run again: the share of positions where the skipping stack's
   top token is the full model's is the acceptance a greedy draft would see there.
3. The cost of a draft token (a one-token forward, skipping) and of verifying k + 1 tokens, each against a
   one-token full forward, are timed here.

The count with the most expected tokens per unit of time, (1 - a^(k+1)) / (1 - a) / (k c + v), wins. The
text is draftwise's own engine.py (prose and code; nothing a benchmark measures). A named model's plan is
kept under $DRAFTWISE_HOME/calibration (the file the kernel timings use), so the second load pays nothing.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from importlib.resources import files

import torch

from draftwise.adaptive import expected_tokens
from draftwise.proposers.layer_skip import decoder_layers, skipping

CALIBRATION_TOKENS = 192
SKIP_SHARES = (1 / 8, 1 / 4, 3 / 8, 1 / 2)
TIMING_REPEATS = 5


@dataclass(frozen=True)
class SkipPlan:
    skip: tuple[int, ...]  # the decoder layers the draft passes over
    agreement: float  # share of calibration positions where the draft's top token is the target's
    cost: float  # c: a draft token's time over a one-token target forward
    candidates: tuple[dict, ...] = ()  # every count tried: {"skip", "agreement", "cost", "rate"}


def calibration_ids(tokenizer, tokens: int = CALIBRATION_TOKENS) -> list[int]:
    text = files("draftwise").joinpath("engine.py").read_text(encoding="utf-8")
    return tokenizer(text)["input_ids"][:tokens]


def plan_skip(model: torch.nn.Module, ids: list[int], k: int = 4, cache: bool = True) -> SkipPlan:
    """The skip plan for `model` (cached for a named model on this machine, measured otherwise)."""
    from draftwise.backends.kernels import CalibrationCache

    name = getattr(model.config, "_name_or_path", "") or ""
    store = CalibrationCache(enabled=cache and bool(name))
    key = f"skip:{name}:{model.dtype}:{len(decoder_layers(model))}:{len(ids)}:k{k}"
    if (entry := store.get(key)) is not None:
        return SkipPlan(tuple(entry["skip"]), entry["agreement"], entry["cost"], tuple(entry["candidates"]))
    plan = measure_skip(model, ids, k)
    store.put(key, {**asdict(plan), "skip": list(plan.skip), "candidates": list(plan.candidates)})
    store.save()
    return plan


@torch.inference_mode()
def measure_skip(model: torch.nn.Module, ids: list[int], k: int = 4) -> SkipPlan:
    count = len(decoder_layers(model))
    input_ids = torch.tensor([ids], device=model.device)  # [1, T]
    full = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    target_top = full.logits[0].argmax(-1)  # [T]
    order = skip_order(full.hidden_states)
    one_token = _timed(model, input_ids[:, :1])
    verify = _timed(model, input_ids[:, : k + 1]) / one_token
    candidates = []
    for n in sorted({max(1, min(len(order), round(count * share))) for share in SKIP_SHARES}):
        skip = tuple(sorted(order[:n]))
        with skipping(model, skip):
            agreement = float((model(input_ids=input_ids, use_cache=False).logits[0].argmax(-1) == target_top)
                              .float().mean())
            cost = _timed(model, input_ids[:, :1]) / one_token
        rate = expected_tokens(agreement, k) / (k * cost + verify)
        candidates.append({"skip": list(skip), "agreement": round(agreement, 4), "cost": round(cost, 4),
                           "rate": round(rate, 4)})
    best = max(candidates, key=lambda c: c["rate"])
    return SkipPlan(tuple(best["skip"]), best["agreement"], best["cost"], tuple(candidates))


def skip_order(hidden_states: tuple[torch.Tensor, ...]) -> list[int]:
    """Layers that may be skipped, least influential first. hidden_states: the embeddings, then each layer's
    output, [1, T, H] each (transformers' output_hidden_states)."""
    count = len(hidden_states) - 1
    influence = [
        float(1 - torch.nn.functional.cosine_similarity(hidden_states[i], hidden_states[i + 1], dim=-1).mean())
        for i in range(count)
    ]
    movable = range(1, count - 1) if count >= 4 else range(1, count)
    return sorted(movable, key=lambda i: influence[i])


def _timed(model: torch.nn.Module, input_ids: torch.Tensor) -> float:
    """Median seconds of a forward (after one untimed run)."""
    model(input_ids=input_ids, use_cache=False)
    times = []
    for _ in range(TIMING_REPEATS):
        started = time.perf_counter()
        model(input_ids=input_ids, use_cache=False)
        times.append(time.perf_counter() - started)
    return statistics.median(times)
