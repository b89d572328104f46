"""A two-turn environment for tests/integration/test_eval.py, loaded by import path (`eval_envs:TwoTurns`)."""

from __future__ import annotations

import random

from asyncrl.environments.base import Environment, Example, Messages, State
from asyncrl.environments.rubric import Rubric


def answer_length(completion: str, example: Example) -> float:
    return min(len(completion), 8) / 8


class TwoTurns(Environment):
    """The model answers a word, the environment asks once more, the model answers again."""

    name = "two_turns"

    def __init__(self, **limits):
        super().__init__(**limits)
        self.rubric = Rubric(rewards=[(answer_length, 1.0)])

    def examples(self, seed: int):
        rng = random.Random(seed)
        while True:
            word = "".join(rng.choice("abcdef") for _ in range(3))
            yield Example(prompt=[{"role": "user", "content": word}], answer=word)

    async def respond(self, messages: Messages, state: State, example: Example) -> Messages | None:
        if state.get("asked"):
            return None
        state["asked"] = True
        return [{"role": "user", "content": "again"}]
