"""Environments for tests/integration/test_env_server.py, loaded by import path in an env-server's workers."""

from __future__ import annotations

import os
import time

from asyncrl.environments.base import Environment, Example, Messages, State
from asyncrl.environments.rubric import Rubric


def prompt(text: str, **info) -> Example:
    return Example(prompt=[{"role": "user", "content": text}], answer=text[::-1], info=info)


class Slow(Environment):
    """A reward that holds whatever runs it for `seconds`: a blocking sleep inside an async function (in the
    orchestrator's process that stops its event loop), or a busy loop burning CPU."""

    name = "slow"

    def __init__(self, seconds: float = 4.0, kind: str = "sleep", **limits):
        super().__init__(**limits)

        async def sleeping(completion: str) -> float:
            time.sleep(seconds)
            return 1.0

        def burning(completion: str) -> float:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                pass
            return 1.0

        self.rubric = Rubric([(sleeping if kind == "sleep" else burning, 1.0)], timeout=3 * seconds)

    def examples(self, seed: int):
        while True:
            yield prompt("slow")


def behave(completion: str, example: Example) -> float:
    mode = example.info["mode"]
    if mode == "crash":
        os._exit(3)
    if mode == "hang":
        time.sleep(3600)
    return 1.0


class Fragile(Environment):
    """Each example says how its reward or respond() misbehaves: crash, hang, raise, or not at all."""

    name = "fragile"

    def __init__(self, **limits):
        super().__init__(**limits)
        self.rubric = Rubric([(behave, 1.0)], timeout=3600)

    def examples(self, seed: int):
        modes = ["ok", "crash", "hang", "ok", "respond_crash", "respond_raise", "ok"]
        while True:
            yield from (prompt(mode, mode=mode) for mode in modes)

    async def respond(self, messages: Messages, state: State, example: Example, turn: int) -> Messages | None:
        if example.info["mode"] == "respond_crash":
            os._exit(4)
        if example.info["mode"] == "respond_raise":
            raise KeyError("board")
        state["turns_seen"] = turn
        return None


class Numbered(Environment):
    """Examples numbered from 0 (`total` of them, or endless), each taking `seconds` to make, as a slow
    dataset's would."""

    name = "numbered"

    def __init__(self, seconds: float = 0.0, total: int | None = None, **limits):
        super().__init__(**limits)
        self.seconds, self.total = seconds, total
        self.rubric = Rubric([(lambda completion: 1.0, 1.0)])

    def examples(self, seed: int):
        index = 0
        while self.total is None or index < self.total:
            time.sleep(self.seconds)
            yield prompt(f"example {index}", index=index)
            index += 1
