"""A rubric scores a finished rollout: weighted reward functions plus unweighted metrics.

A reward function takes `(completion, example)` — the last assistant message and the `Example` — or
`(completion, example, state)`, where `state` is what the environment kept during a multi-turn episode;
it returns a float and may be sync or async. One that raises, times out or returns NaN marks the rollout
as errored: the rollout is counted and left out of training, and the run goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.environments.base import Example, State

RewardFn = Callable[..., float]


@dataclass
class Score:
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def _wants_state(fn: RewardFn) -> bool:
    return len(inspect.signature(fn).parameters) >= 3


class Rubric:
    def __init__(self, rewards: list[tuple[RewardFn, float]], metrics: list[RewardFn] = (), timeout: float = 30.0):
        self.rewards = list(rewards)
        self.metrics = list(metrics)
        self.timeout = timeout

    async def _call(self, fn: RewardFn, completion: str, example: Example, state: State) -> float:
        args = (completion, example, state) if _wants_state(fn) else (completion, example)
        if inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(fn(*args), self.timeout)
        else:
            value = await asyncio.wait_for(asyncio.to_thread(fn, *args), self.timeout)
        value = float(value)
        if math.isnan(value):
            raise ValueError("returned NaN")
        return value

    async def score(self, completion: str, example: Example, state: State | None = None) -> Score:
        values: dict[str, float] = {}
        state = {} if state is None else state
        try:
            for fn in [fn for fn, _ in self.rewards] + self.metrics:
                values[fn.__name__] = await self._call(fn, completion, example, state)
        except Exception as e:  # noqa: BLE001 - any failure of user code marks the rollout, never the run
            reason = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            return Score(reward=0.0, metrics=values, error=f"{fn.__name__} {reason}")
        reward = sum(weight * values[fn.__name__] for fn, weight in self.rewards)
        return Score(reward=reward, metrics=values)
