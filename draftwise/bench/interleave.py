"""The order in which a benchmark's contenders run in each repeat, shared by `bench` (methods on one prompt) and
`loadgen` (speculation modes and methods at one concurrency), so that a machine's drift weighs on all alike."""
from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def order_for_repeat(items: Sequence[T], repeat: int) -> list[T]:
    """Repeats in pairs: the even one rotated by the pair's number, the odd one its mirror. A mirrored pair puts each
    contender as far from the pair's midpoint in one as in the other, so that a drift steady over the pair (a machine
    slowing down) weighs on all alike, already in two repeats; across pairs the rotation moves who goes first, and
    neighbours change. (Rotated by the repeat's number instead, and reversed on odd repeats, two repeats of three
    would start with the same contender, and two of two run in the same order.)"""
    items = list(items)
    if not items:
        return items
    shift = (repeat // 2) % len(items)
    order = items[shift:] + items[:shift]
    return order[::-1] if repeat % 2 else order
