"""A small verifiers (0.4, `verifiers.v1`) environment for tests/integration/test_verifiers.py: reverse a
short string. Its taskset id is `vf-reverse-text`; this folder must be on `sys.path` (verifiers imports a
taskset by its id)."""

from __future__ import annotations

import difflib
import random

import verifiers.v1 as vf


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def similarity(self, trace: vf.Trace) -> float:
        return difflib.SequenceMatcher(None, trace.last_reply.strip(), self.data.answer).ratio()

    @vf.metric
    async def exact_match(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 16
    seed: int = 0


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self) -> list[ReverseTask]:
        rng = random.Random(self.config.seed)
        texts = [
            "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 6))) for _ in range(self.config.num_tasks)
        ]
        return [ReverseTask(ReverseData(prompt=text, answer=text[::-1]), self.config.task) for text in texts]


__all__ = ["ReverseTaskset"]
