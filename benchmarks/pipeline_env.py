"""The long-tail workload of benchmarks/pipeline.py, loaded by the orchestrator as `pipeline_env:LongTail`.

Each group's completion length is drawn from a log-normal distribution (EOS is ignored, so every sample of
the group runs to exactly that length), as agentic rollouts' lengths are: most short, a few very long. The
reward is the share of distinct tokens in the answer — cheap, and different from sample to sample, so every
group carries signal and the trainer trains on every batch.
"""

from __future__ import annotations

import math
import random

from asyncrl.environments.base import Completion, Environment, Example, Rollout, TokenSample
from asyncrl.environments.rubric import Rubric


class LongTail(Environment):
    name = "long_tail"

    def __init__(self, median_tokens: int = 64, sigma: float = 1.0, max_tokens: int = 512, prompt_tokens: int = 32):
        super().__init__()
        self.median_tokens, self.sigma, self.max_tokens = median_tokens, sigma, max_tokens
        self.prompt_tokens = prompt_tokens
        self.rubric = Rubric([])

    def examples(self, seed: int):
        rng = random.Random(seed)
        while True:
            length = int(min(max(rng.lognormvariate(math.log(self.median_tokens), self.sigma), 1), self.max_tokens))
            prompt = [rng.randrange(32, 127) for _ in range(self.prompt_tokens)]
            yield Example([], "", {"prompt_ids": prompt, "max_tokens": length})

    async def rollout_group(self, example: Example, policy, group_size: int) -> list[Rollout]:
        prompt = example.info["prompt_ids"]
        completions: list[Completion] = await policy.generate(prompt, group_size, example.info["max_tokens"])
        rollouts = []
        for c in completions:
            sample = TokenSample(list(prompt), [False] * len(prompt), [0.0] * len(prompt))
            sample.extend(c.token_ids, c.logprobs)
            reward = len(set(c.token_ids)) / max(len(c.token_ids), 1)
            rollouts.append(Rollout(example, [sample], [], c.policy_versions, "", c.finish_reason, reward=reward))
        return rollouts
