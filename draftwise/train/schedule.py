"""The learning-rate schedule every trainer here uses."""
from __future__ import annotations

import math


def lr_scale(step: int, warmup_steps: int, total: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    done = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))
