"""A custom loss (loss.custom = "failing_loss:fail") that raises at the first step: a trainer that fails the
same way on any machine, for the tests of what `asyncrl rl` does when its trainer dies."""

from __future__ import annotations


def fail(inputs, cfg):
    raise RuntimeError("the custom loss failed on purpose")
