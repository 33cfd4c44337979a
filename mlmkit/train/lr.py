"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr`` (Megatron-LM's default shape)."""

from __future__ import annotations

import math

__all__ = ["lr_at"]


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based); ``min_lr`` from ``max_steps`` on.

    Warm-up ``lr (step + 1) / warmup_steps`` for steps ``0 .. warmup_steps - 1``, then cosine from
    ``lr`` at step ``warmup_steps`` to ``min_lr`` at ``max_steps``: Megatron-LM's cosine exactly
    (``OptimizerParamScheduler``, decay ratio ``(step - warmup) / (max - warmup)``). Its warm-up is
    one step behind: it sets the rate after each update, so its first update uses ``init_lr`` (0)
    and its warm-up reaches ``lr`` at step ``warmup_steps``; here no update runs with a zero rate."""
    if step >= max_steps:
        return min_lr
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
