"""Learning-rate schedules against values computed by hand (docs: trainer/schedule.py's formulas)."""

from __future__ import annotations

import pytest

from asyncrl.config.schema import OptimConfig
from asyncrl.trainer.schedule import learning_rate


def lrs(max_steps: int, **optim) -> list[float]:
    cfg = OptimConfig(lr=1.0, **optim)
    return [learning_rate(step, cfg, max_steps) for step in range(1, max_steps + 1)]


def test_constant_is_lr_at_every_step():
    assert lrs(5) == [1.0] * 5


def test_warmup_climbs_linearly_from_lr_over_warmup_steps_then_holds():
    assert lrs(6, warmup_steps=4) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_linear_decay_reaches_min_lr_at_the_last_step():
    # W = 2, max_steps = 6: p = (s - 2) / 4 for s = 3..6; lr = 0.1 + 0.9 (1 - p).
    assert lrs(6, warmup_steps=2, scheduler="linear", min_lr_ratio=0.1) == pytest.approx(
        [0.5, 1.0, 0.775, 0.55, 0.325, 0.1]
    )


def test_cosine_decay_follows_half_a_cosine_to_min_lr():
    # W = 1, max_steps = 5: p = (s - 1) / 4; lr = (1 + cos(pi p)) / 2 with min_lr 0.
    # cos(pi/4) = 0.70711 -> 0.85355; cos(pi/2) = 0 -> 0.5; cos(3pi/4) -> 0.14645; cos(pi) -> 0.
    assert lrs(5, warmup_steps=1, scheduler="cosine") == pytest.approx([1.0, 0.853553, 0.5, 0.146447, 0.0], abs=1e-6)


def test_decay_without_warmup_starts_below_lr_and_ends_at_min_lr():
    assert lrs(4, scheduler="linear", min_lr_ratio=0.2) == pytest.approx([0.8, 0.6, 0.4, 0.2])


def test_steps_past_max_steps_stay_at_min_lr():
    cfg = OptimConfig(lr=2.0, scheduler="cosine", min_lr_ratio=0.5)
    assert learning_rate(12, cfg, 10) == pytest.approx(1.0)
