"""A rubric scores a finished rollout: weighted reward functions plus unweighted metrics.

A reward function's parameters are filled by name from what the finished episode holds: `completion` (the
last assistant message), `example` (the `Example`), `state` (what the environment kept during the episode),
`messages` (the whole conversation), `turns` (assistant turns) and `is_truncated` (whether a limit ended
the episode). It takes any of them, returns a float and may be sync or async. One that raises, times out or
returns NaN marks the rollout as errored: the rollout is counted and left out of training, and the run goes
on.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.environments.base import Example, Messages, State

RewardFn = Callable[..., float]
ARGUMENTS = ("completion", "example", "state", "messages", "turns", "is_truncated")


@dataclass
class Score:
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def _parameters(fn: RewardFn) -> list[str]:
    """The names `fn` takes, checked once when the rubric is built so a typo fails before the first rollout."""
    names = []
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.name not in ARGUMENTS:
            if parameter.default is parameter.empty:
                raise ValueError(
                    f"reward function '{fn.__name__}' takes '{parameter.name}'; reward functions take any of "
                    f"{', '.join(ARGUMENTS)} (by name)"
                )
            continue
        names.append(parameter.name)
    return names


class Rubric:
    def __init__(self, rewards: list[tuple[RewardFn, float]], metrics: list[RewardFn] = (), timeout: float = 30.0):
        self.rewards = list(rewards)
        self.metrics = list(metrics)
        self.timeout = timeout
        self._parameters = {fn: _parameters(fn) for fn in [fn for fn, _ in self.rewards] + self.metrics}

    async def _call(self, fn: RewardFn, episode: dict[str, Any]) -> float:
        kwargs = {name: episode[name] for name in self._parameters[fn]}
        if inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(fn(**kwargs), self.timeout)
        else:
            value = await asyncio.wait_for(asyncio.to_thread(fn, **kwargs), self.timeout)
        value = float(value)
        if math.isnan(value):
            raise ValueError("returned NaN")
        return value

    async def score(
        self,
        completion: str,
        example: Example,
        state: State | None = None,
        messages: Messages | None = None,
        turns: int = 1,
        is_truncated: bool = False,
    ) -> Score:
        episode = {
            "completion": completion,
            "example": example,
            "state": {} if state is None else state,
            "messages": [*example.prompt, {"role": "assistant", "content": completion}]
            if messages is None
            else messages,
            "turns": turns,
            "is_truncated": is_truncated,
        }
        values: dict[str, float] = {}
        try:
            for fn in [fn for fn, _ in self.rewards] + self.metrics:
                values[fn.__name__] = await self._call(fn, episode)
        except Exception as e:  # noqa: BLE001 - any failure of user code marks the rollout, never the run
            reason = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            return Score(reward=0.0, metrics=values, error=f"{fn.__name__} {reason}")
        reward = sum(weight * values[fn.__name__] for fn, weight in self.rewards)
        return Score(reward=reward, metrics=values)
