"""The learning rate of each step: linear warm-up, then constant, linear or cosine decay to `min_lr_ratio`·lr.

A pure function of the step (1-based), so a resumed run needs only its step to continue the schedule.

    warm-up, step s <= W:   lr · s / W
    after it, p = (s - W) / (max_steps - W):
        constant            lr
        linear              min + (lr - min) · (1 - p)
        cosine              min + (lr - min) · (1 + cos(π p)) / 2          min = min_lr_ratio · lr
"""

from __future__ import annotations

import math

from asyncrl.config.schema import OptimConfig


def learning_rate(step: int, optim: OptimConfig, max_steps: int) -> float:
    if step <= optim.warmup_steps:
        return optim.lr * step / optim.warmup_steps
    if optim.scheduler == "constant":
        return optim.lr
    progress = min(1.0, (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps))
    min_lr = optim.min_lr_ratio * optim.lr
    if optim.scheduler == "linear":
        return min_lr + (optim.lr - min_lr) * (1.0 - progress)
    return min_lr + (optim.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
