"""Figures of the progress bars (asyncrl/progress.py)."""

from __future__ import annotations

import pytest

from asyncrl.progress import Throughput


def test_throughput_is_the_rate_over_the_window_not_one_steps():
    throughput = Throughput(window=3)
    throughput.add(1000, 1.0)
    throughput.add(1000, 9.0)  # one slow step (a busy CPU)
    assert throughput.add(1000, 1.0) == pytest.approx(3000 / 11)
    assert throughput.add(4000, 1.0) == pytest.approx(6000 / 11)  # the first step has left the window
