"""A rubric scores a finished rollout: weighted reward functions plus unweighted metrics.

A reward function takes `(completion, example)` — the completion text and the `Example` — and returns a
float; it may be sync or async. One that raises, times out or returns NaN marks the rollout as errored:
the rollout is counted and left out of training, and the run goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.environments.base import Example

RewardFn = Callable[[str, Example], float]


@dataclass
class Score:
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None


class Rubric:
    def __init__(self, rewards: list[tuple[RewardFn, float]], metrics: list[RewardFn] = (), timeout: float = 30.0):
        self.rewards = list(rewards)
        self.metrics = list(metrics)
        self.timeout = timeout

    async def _call(self, fn: RewardFn, completion: str, example: Example) -> float:
        if inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(fn(completion, example), self.timeout)
        else:
            value = await asyncio.wait_for(asyncio.to_thread(fn, completion, example), self.timeout)
        value = float(value)
        if math.isnan(value):
            raise ValueError("returned NaN")
        return value

    async def score(self, completion: str, example: Example) -> Score:
        values: dict[str, float] = {}
        try:
            for fn in [fn for fn, _ in self.rewards] + self.metrics:
                values[fn.__name__] = await self._call(fn, completion, example)
        except Exception as e:  # noqa: BLE001 - any failure of user code marks the rollout, never the run
            reason = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            return Score(reward=0.0, metrics=values, error=f"{fn.__name__} {reason}")
        reward = sum(weight * values[fn.__name__] for fn, weight in self.rewards)
        return Score(reward=reward, metrics=values)
