"""Environments for the streaming tests (tests/integration/test_pool.py), loaded by import path
(`pipeline_envs:Stragglers`) from the orchestrator process."""

from __future__ import annotations

import asyncio

from asyncrl.environments.base import Example, Messages, State
from asyncrl.environments.reverse_text import ReverseText


class Stragglers(ReverseText):
    """reverse_text in two turns ("again" after the first answer), where some environments are slow to answer:
    example i waits `delays[i % len(delays)]` seconds before it does. A long tail of slow episodes, as agentic
    environments have, while the trainer keeps publishing new weights: an episode's second turn may be sampled
    by newer weights than its first. A spread of short delays makes that happen whatever a step takes on the
    machine (0.1 s on a GPU, a second on a loaded CPU) without every such episode turning stale."""

    name = "stragglers"

    def __init__(self, delays: tuple[float, ...] = (1.5, 20.0, 0.0, 0.0), **args):
        super().__init__(**args)
        self.delays = tuple(delays)

    def examples(self, seed: int):
        for number, example in enumerate(super().examples(seed)):
            yield Example(example.prompt, example.answer, {"delay": self.delays[number % len(self.delays)]})

    async def respond(self, messages: Messages, state: State, example: Example) -> Messages | None:
        if len(messages) > len(example.prompt) + 1:
            return None
        await asyncio.sleep(example.info["delay"])
        return [{"role": "user", "content": "again"}]
