"""Group-relative advantages (GRPO): each rollout's reward compared with the other answers to the same
prompt. docs/algorithms.md states the formula; tests/unit/test_advantages.py checks it."""

from __future__ import annotations

import statistics

# Rewards closer than this are treated as equal: such a group teaches nothing.
ZERO = 1e-8


def grpo_advantages(rewards: list[float], std_normalize: bool = False) -> list[float]:
    """A_i = r_i - mean(r); divided by the group's (population) std when `std_normalize`."""
    mean = statistics.fmean(rewards)
    advantages = [r - mean for r in rewards]
    if std_normalize:
        std = statistics.pstdev(rewards)
        advantages = [a / (std + 1e-6) for a in advantages]
    return advantages


def carries_signal(advantages: list[float]) -> bool:
    """A group whose advantages are all zero adds nothing to the loss and is left out."""
    return any(abs(a) > ZERO for a in advantages)
