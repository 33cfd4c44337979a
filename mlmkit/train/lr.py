"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr`` (Megatron-LM's default shape)."""

from __future__ import annotations

import math

__all__ = ["lr_at"]


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based); ``min_lr`` from ``max_steps`` on."""
    if step >= max_steps:
        return min_lr
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
