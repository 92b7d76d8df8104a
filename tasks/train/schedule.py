"""Learning rate as a pure function of the step, so a resumed run continues on the same curve."""

from __future__ import annotations

import math

from tasks.configs import OptimConfig


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Linear warmup from lr/warmup_steps to lr, then cosine decay to min_lr_ratio * lr at
    max_steps (and flat after it)."""
    if step < optim.warmup_steps:
        # (step + 1): the first step already moves, instead of wasting a step at lr = 0
        return optim.lr * (step + 1) / optim.warmup_steps
    min_lr = optim.min_lr_ratio * optim.lr
    decay_steps = max_steps - optim.warmup_steps
    if decay_steps <= 0:
        return optim.lr
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (optim.lr - min_lr)
