"""Drafting for many sequences at once: their draft-model forwards share one batched pass per draft step.

A proposer that can take part declares it (Capabilities.drafts_in_steps: DraftModelProposer, DraftTreeProposer,
LayerSkipProposer and HybridProposer) and has the round in steps (proposers/base.py):
start(context, k, stop_confidence); while pending() gives tokens to feed, take(the logits row after them);
settle() (in `finally`: the cache holds the proposer's tokens, and a grown tree's fed nodes until verification);
finish() -> Draft. Its `backend` is its slot of a shared HFBackend (a SlotView). A tree proposer feeds a depth of
its tree per forward: its pending_layout() is that row's tree (the backend's tree mask and positions), with
takes_rows its take() gets the logits of every token fed, not just the last, and time_forward(seconds) tells it
what each forward it took part in cost (in a batch, the shared forward's time: what one more depth costs there).
Any other proposer (prompt lookup, the feature head) just propose()s.
"""
from __future__ import annotations

import time

from draftwise.backends.base import SharedBackend, SlotView
from draftwise.proposers.base import Proposer
from draftwise.types import Draft


def run_round(proposer: Proposer, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
    """One proposer's round alone: the batch of one."""
    proposer.start(context, k, stop_confidence)
    try:
        while (feed := proposer.pending()) is not None:
            started, layout = time.perf_counter(), proposer.pending_layout()
            if layout is None:
                logits = proposer.backend.forward(feed)  # [fed, vocab]
            else:
                model, slot = _shared(proposer.backend)
                logits = model.forward_batch([(slot, feed)], trees=[layout])[0]
            proposer.time_forward(time.perf_counter() - started)
            proposer.take(_rows_for(proposer, logits))
    finally:
        proposer.settle()
    return proposer.finish()


def propose_many(proposers: list[Proposer], contexts: list[list[int]], ks: list[int],
                 stop_confidences: list[float]) -> list[Draft | BaseException]:
    """Each proposer's draft, or the exception that ended its round (the others go on).

    Every draft step runs one forward per shared draft model over the sequences still drafting, each row with
    its own new tokens (a sequence catching up after lookup rounds feeds several)."""
    results: list[Draft | BaseException | None] = [None] * len(proposers)
    stepped = []
    for i, (proposer, context, k, stop) in enumerate(zip(proposers, contexts, ks, stop_confidences)):
        try:
            # Alone, a proposer runs its own round: no batch to share a forward with.
            if k > 0 and proposer.capabilities.drafts_in_steps and len(proposers) > 1:
                stepped.append(i)  # (before start: a start that raised has still to settle)
                proposer.start(context, k, stop)
            else:
                results[i] = proposer.propose(context, k, stop) if k > 0 else Draft(token_ids=())
        except Exception as err:  # one sequence's proposer failing must not end the others' rounds
            results[i] = err
    try:
        _step_together(proposers, stepped, results)
    finally:  # even on an interrupt, every cache is left holding exactly its proposer's tokens
        for i in stepped:
            try:
                proposers[i].settle()
            except Exception as err:
                results[i] = err
    for i in stepped:
        try:
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
            trees = [proposers[i].pending_layout() for i, _ in group]
            # (a backend without trees, layer skipping's, never gets the argument: none of its rows is a tree)
            with_trees = {"trees": trees} if any(t is not None for t in trees) else {}
            started = time.perf_counter()
            try:
                rows = shared.forward_batch([(_shared(proposers[i].backend)[1], feed) for i, feed in group],
                                            **with_trees)
            except Exception as err:
                _step_alone(proposers, group, shared, trees, results, err)
                continue
            seconds = time.perf_counter() - started
            for (i, _), logits in zip(group, rows):
                _take(proposers, i, logits, seconds, results)


def _step_alone(proposers: list, group: list, shared, trees: list, results: list, shared_error: Exception) -> None:
    """The shared draft forward failed: each of its rows once more on its own, so that what one sequence alone brings
    ends its own round, not every round in the forward (as the target's pass does: round.Round.verify_alone). A row moves
    its slot only once its forward has succeeded, so nothing is left to undo."""
    if len(group) == 1:
        results[group[0][0]] = shared_error
        return
    for (i, feed), tree in zip(group, trees):
        started = time.perf_counter()
        try:
            logits = shared.forward_batch([(_shared(proposers[i].backend)[1], feed)],
                                          **({"trees": [tree]} if tree is not None else {}))[0]
        except Exception as own:
            results[i] = own
            continue
        _take(proposers, i, logits, time.perf_counter() - started, results)


def _take(proposers: list, i: int, logits, seconds: float, results: list) -> None:
    try:
        proposers[i].time_forward(seconds)
        proposers[i].take(_rows_for(proposers[i], logits))
    except Exception as err:
        results[i] = err


def _rows_for(proposer: Proposer, logits):
    """What take() expects of a forward's logits [fed, vocab]: every row (a tree's depth), or the last one."""
    return logits if proposer.capabilities.takes_rows else logits[-1]


def _shared(backend: SharedBackend | SlotView) -> tuple[SharedBackend, SlotView]:
    """(the model's backend, the sequence's slot): a bare backend stands for its default slot."""
    return (backend.backend, backend) if isinstance(backend, SlotView) else (backend, backend.default)
