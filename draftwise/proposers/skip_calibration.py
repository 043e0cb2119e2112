"""Which layers the `skip` method passes over, chosen on this machine for this model.

1. One full forward over a calibration text gives each layer's influence: how far it turns the residual
   stream, 1 - cos(input, output) averaged over the tokens (ShortGPT's block influence). Layers that barely
   turn it are the ones to skip first; the first layer is never skipped (it reads the raw embeddings), nor
   the last of four or more (it writes what the output layer reads).
2. For a few skip counts n (none where the draft runs cheaper copies of the layers, then an eighth, a quarter,
   three eighths and half of them), the n least influential are skipped and the text is drafted as the engine
   drafts it: in rounds of AGREEMENT_ROUND tokens, one token a forward, in the target's own cache of the text
   before the round (the engine's slot). The share of positions where the draft's top token is the full
   model's is the acceptance a greedy draft would see there.
3. The cost of a draft token (a one-token forward as the draft) and of verifying k + 1 tokens, each against
   a one-token full forward, are timed here.

The count whose chains of k the round planner (planner.py) prices highest, at those timed costs, wins. The
text is draftwise's own prose and code (calibration_text.py; nothing a benchmark measures). A named model's plan is
kept under $DRAFTWISE_HOME/calibration (the file the kernel timings use), so the second load pays nothing.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from draftwise import planner
from draftwise.backends.hf import HFBackend
from draftwise.config import DEFAULT_DRAFT_TOKENS
from draftwise.proposers.calibration_text import CALIBRATION_TEXT
from draftwise.proposers.compact import target_ids
from draftwise.proposers.layer_skip import DraftStack, decoder_layers, drafting

CALIBRATION_TOKENS = 192
SKIP_SHARES = (1 / 8, 1 / 4, 3 / 8, 1 / 2)
AGREEMENT_ROUND = 8  # tokens drafted in a row before the target's cache takes over again
TIMING_REPEATS = 5
PLAN_VERSION = 3  # part of the cache key: 3 drafts one token a forward on the stack's copies, in the target's cache


@dataclass(frozen=True)
class SkipPlan:
    skip: tuple[int, ...]  # the decoder layers the draft passes over
    agreement: float  # share of calibration positions where the draft's top token is the target's
    cost: float  # c: a draft token's time over a one-token target forward
    candidates: tuple[dict, ...] = ()  # every count tried: {"skip", "agreement", "cost", "rate"}


def calibration_ids(tokenizer, tokens: int = CALIBRATION_TOKENS) -> list[int]:
    return tokenizer(CALIBRATION_TEXT)["input_ids"][:tokens]


def plan_skip(target: HFBackend, ids: list[int], k: int = DEFAULT_DRAFT_TOKENS, cache: bool = True,
              stack: DraftStack | None = None) -> SkipPlan:
    """The skip plan for target's model drafting on stack (cached for a named model on this machine, measured
    otherwise). target's default slot is used for the measurement and left empty."""
    from draftwise.backends.kernels import CalibrationCache

    stack = stack or DraftStack()
    model = target.model
    name = getattr(model.config, "_name_or_path", "") or ""
    store = CalibrationCache(enabled=cache and bool(name))
    key = f"skip-v{PLAN_VERSION}:{name}:{model.dtype}:{len(decoder_layers(model))}:{len(ids)}:k{k}:{stack.describe()}"
    entry = store.get(key)
    try:
        if entry is not None:
            return SkipPlan(tuple(entry["skip"]), entry["agreement"], entry["cost"], tuple(entry["candidates"]))
    except (KeyError, TypeError):  # a damaged or hand-edited entry is measured again, never trusted
        pass
    plan = measure_skip(target, ids, k, stack)
    store.put(key, {**asdict(plan), "skip": list(plan.skip), "candidates": list(plan.candidates)})
    store.save()
    return plan


@torch.inference_mode()
def measure_skip(target: HFBackend, ids: list[int], k: int = DEFAULT_DRAFT_TOKENS,
                 stack: DraftStack | None = None) -> SkipPlan:
    stack = stack or DraftStack()
    model = target.model
    count = len(decoder_layers(model))
    input_ids = torch.tensor([ids], device=model.device)  # [1, T]
    order = skip_order(model(input_ids=input_ids, output_hidden_states=True, use_cache=False).hidden_states)
    one_token = _timed(model, input_ids[:, :1])
    verify = _timed(model, input_ids[:, : k + 1]) / one_token
    counts = {max(1, min(len(order), round(count * share))) for share in SKIP_SHARES}
    counts |= {0} if stack.cheaper else set()  # skipping none pays only where the layers it runs are cheaper
    drafts = [stack.skipping(order[:n]) for n in sorted(counts)]
    agreements = _agreements(target, ids, drafts)
    candidates = []
    for draft, agreement in zip(drafts, agreements):
        with drafting(model, draft):
            cost = _timed(model, input_ids[:, :1]) / one_token
        rate = planner.rate(planner.FlatPrices(draft_s=cost, pass_s=verify), 1, [planner.Offer.of_chain(agreement, k)])
        candidates.append({"skip": list(draft.skip), "agreement": round(agreement, 4), "cost": round(cost, 4),
                           "rate": round(rate, 4)})
    best = max(candidates, key=lambda c: c["rate"])
    return SkipPlan(tuple(best["skip"]), best["agreement"], best["cost"], tuple(candidates))


def _agreements(target: HFBackend, ids: list[int], drafts: list[DraftStack]) -> list[float]:
    """For each draft, the share of ids' positions where its top token is the full model's. Each round of
    AGREEMENT_ROUND tokens is drafted one token a forward (as the engine drafts: an int8-dynamic copy's activation
    scale is then one row's) on the full model's cache of the text before the round, which the full model then
    writes. Uses target's default slot, and empties it: call it before any sequence holds that slot."""
    slot = target.default
    slot.trim(0)
    agree, positions = [0] * len(drafts), 0
    try:
        for start in range(0, len(ids), AGREEMENT_ROUND):
            chunk = ids[start : start + AGREEMENT_ROUND]
            tops = [_drafted_tops(target.model, slot, chunk, draft) for draft in drafts]
            slot.trim(start)
            full_top = slot.forward(chunk).argmax(-1)  # [n]: the full model writes the cache the next round reads
            agree = [a + int((top == full_top).sum()) for a, top in zip(agree, tops)]
            positions += len(chunk)
    finally:
        slot.trim(0)
    return [a / max(positions, 1) for a in agree]


def _drafted_tops(model, slot, chunk: list[int], draft: DraftStack) -> torch.Tensor:
    """[n]: the draft's top token (a target id) after each token of chunk, fed one a forward; the slot is put
    back to where it was."""
    start = slot.cache_len
    with drafting(model, draft):
        rows = [slot.forward([token]) for token in chunk]  # [1, vocab'] each
    slot.trim(start)
    return target_ids(torch.cat(rows).argmax(-1), draft.token_ids)


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
