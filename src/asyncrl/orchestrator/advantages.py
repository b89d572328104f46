"""Group-relative advantages: each rollout's reward compared with the other answers to the same prompt.

GRPO, Dr.GRPO-style and RLOO baselines, with an optional length penalty. docs/algorithms.md states the
formulas; tests/unit/test_advantages.py checks them on hand-computed values.
"""

from __future__ import annotations

import statistics

from asyncrl.config.schema import AdvantageConfig

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


def rloo_advantages(rewards: list[float]) -> list[float]:
    """A_i = r_i - mean of the other rewards (leave-one-out); a group of one has no baseline: 0."""
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    total = sum(rewards)
    return [r - (total - r) / (len(rewards) - 1) for r in rewards]


def length_penalized(rewards: list[float], lengths: list[int], penalty: float) -> list[float]:
    """r_i - penalty * L_i / max(L): the longest answer of the group pays `penalty`, an empty one nothing."""
    longest = max(lengths, default=0)
    if penalty == 0 or longest == 0:
        return list(rewards)
    return [r - penalty * n / longest for r, n in zip(rewards, lengths)]


def group_advantages(rewards: list[float], lengths: list[int], cfg: AdvantageConfig) -> list[float]:
    """The advantages of one group under an environment's settings. `lengths` are completion tokens.

    Dr.GRPO's two fixes to GRPO are no std division and no per-answer length normalisation; our loss never
    divides an answer's terms by its own length (it divides the batch sum by the batch's loss tokens), so
    `dr_grpo` is the mean baseline with std division ruled out.
    """
    shaped = length_penalized(rewards, lengths, cfg.length_penalty)
    if cfg.estimator == "rloo":
        return rloo_advantages(shaped)
    return grpo_advantages(shaped, std_normalize=cfg.estimator == "grpo" and cfg.std_normalize)


def carries_signal(advantages: list[float]) -> bool:
    """A group whose advantages are all zero adds nothing to the loss and is left out."""
    return any(abs(a) > ZERO for a in advantages)
