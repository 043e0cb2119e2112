"""Drafting for many sequences at once: their draft-model forwards share one batched pass per draft step.

A proposer that can take part has the round in steps (DraftModelProposer and HybridProposer do):
start(context, k, stop_confidence); while pending() gives tokens to feed, take(the logits row after them);
settle() (in `finally`: the cache holds exactly the proposer's tokens); finish() -> Draft. Its `backend` is its
slot of a shared HFBackend (a SlotView). Any other proposer (prompt lookup), and one whose class sets
steps_in_lockstep = False (a draft-model tree: its forwards are not one row each), just propose()s.
"""
from __future__ import annotations

from draftwise.backends.hf import HFBackend, SlotView
from draftwise.types import Draft


def run_round(proposer, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
    """One proposer's round alone: the batch of one."""
    proposer.start(context, k, stop_confidence)
    try:
        while (feed := proposer.pending()) is not None:
            proposer.take(proposer.backend.forward(feed)[-1])
    finally:
        proposer.settle()
    return proposer.finish()


def propose_many(proposers: list, contexts: list[list[int]], ks: list[int],
                 stop_confidences: list[float]) -> list[Draft | BaseException]:
    """Each proposer's draft, or the exception that ended its round (the others go on).

    Every draft step runs one forward per shared draft model over the sequences still drafting, each row with
    its own new tokens (a sequence catching up after lookup rounds feeds several)."""
    results: list[Draft | BaseException | None] = [None] * len(proposers)
    stepped = []
    for i, (proposer, context, k, stop) in enumerate(zip(proposers, contexts, ks, stop_confidences)):
        try:
            # Alone, a proposer runs its own round: no batch to share a forward with.
            lockstep = hasattr(proposer, "pending") and getattr(proposer, "steps_in_lockstep", True)
            if k > 0 and lockstep and len(proposers) > 1:
                proposer.start(context, k, stop)
                stepped.append(i)
            else:
                results[i] = proposer.propose(context, k, stop) if k > 0 else Draft(token_ids=())
        except Exception as err:  # one sequence's proposer failing must not end the others' rounds
            results[i] = err
    _step_together(proposers, stepped, results)
    for i in stepped:
        try:
            proposers[i].settle()
            if results[i] is None:
                results[i] = proposers[i].finish()
        except Exception as err:
            results[i] = err
    return results


def _step_together(proposers: list, stepped: list[int], results: list) -> None:
    while True:
        waiting = [(i, feed) for i in stepped if results[i] is None and (feed := proposers[i].pending()) is not None]
        if not waiting:
            return
        by_model: dict[int, list[tuple[int, list[int]]]] = {}
        for i, feed in waiting:
            by_model.setdefault(id(_shared(proposers[i].backend)[0]), []).append((i, feed))
        for group in by_model.values():
            shared = _shared(proposers[group[0][0]].backend)[0]
            try:
                rows = shared.forward_batch([(_shared(proposers[i].backend)[1], feed) for i, feed in group])
            except Exception as err:  # the pass was shared: every sequence in it lost its round
                for i, _ in group:
                    results[i] = err
                continue
            for (i, _), logits in zip(group, rows):
                try:
                    proposers[i].take(logits[-1])
                except Exception as err:
                    results[i] = err


def _shared(backend: HFBackend | SlotView) -> tuple[HFBackend, SlotView]:
    """(the model's backend, the sequence's slot): a bare backend stands for its default slot."""
    return (backend.backend, backend) if isinstance(backend, SlotView) else (backend, backend.default)
