"""The order in which a benchmark's contenders run in each repeat, shared by `bench` (methods on one prompt) and
`loadgen` (speculation modes and methods at one concurrency), so that a machine's drift weighs on all alike."""
from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def order_for_repeat(items: Sequence[T], repeat: int) -> list[T]:
    """items rotated by the repeat's number, and run backwards on odd repeats: no contender always goes first, and
    none always follows the same one (a rotation alone keeps each one's neighbours: a tree after its chain every
    time, the very pairs a report sets side by side)."""
    items = list(items)
    if not items:
        return items
    shift = repeat % len(items)
    order = items[shift:] + items[:shift]
    return order[::-1] if repeat % 2 else order
