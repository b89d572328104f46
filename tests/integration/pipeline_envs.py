"""Environments for the streaming tests (tests/integration/test_pool.py), loaded by import path
(`pipeline_envs:Stragglers`) from the orchestrator process."""

from __future__ import annotations

import asyncio

from asyncrl.environments.base import Example, Messages, State
from asyncrl.environments.reverse_text import ReverseText


class Stragglers(ReverseText):
    """reverse_text in two turns ("again" after the first answer), where some environments are slow to answer:
    every `every`-th example's takes `short` seconds, the one after it `long` seconds. A long tail of slow
    episodes, as agentic environments have, while the trainer keeps publishing new weights: an episode's
    second turn may be sampled by newer weights than its first."""

    name = "stragglers"

    def __init__(self, every: int = 4, short: float = 1.5, long: float = 20.0, **args):
        super().__init__(**args)
        self.every, self.short, self.long = every, short, long
        self.count = 0

    def examples(self, seed: int):
        for number, example in enumerate(super().examples(seed)):
            delay = {0: self.short, 1: self.long}.get(number % self.every, 0.0)
            yield Example(example.prompt, example.answer, {"delay": delay})

    async def respond(self, messages: Messages, state: State, example: Example) -> Messages | None:
        if len(messages) > len(example.prompt) + 1:
            return None
        await asyncio.sleep(example.info["delay"])
        return [{"role": "user", "content": "again"}]
