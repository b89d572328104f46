"""Real rollouts of real environments against a running `asyncrl inference`, scored with GRPO advantages,
as the orchestrator scores them: for the samples.jsonl tests and the dashboard's rollout viewer."""

from __future__ import annotations

import asyncio
from pathlib import Path

from asyncrl.config.schema import AdvantageConfig, SamplingConfig
from asyncrl.environments import load_environment
from asyncrl.environments.base import Rollout
from asyncrl.loading import load_tokenizer
from asyncrl.orchestrator.advantages import group_advantages
from asyncrl.orchestrator.client import InferenceClient, ServedPolicy


def scored_group(
    url: str, model_dir: Path, env_name: str, group_size: int = 4, max_tokens: int = 16, seed: int = 0, **env_args
) -> list[tuple[Rollout, float]]:
    """One group of `env_name`'s first example, each rollout with its advantage."""

    async def main() -> list[Rollout]:
        client = InferenceClient(url, None, request_timeout=120)
        policy = ServedPolicy(client, load_tokenizer(str(model_dir)), SamplingConfig(max_tokens=max_tokens), 1024)
        env = load_environment(env_name, **env_args)
        try:
            return await env.rollout_group(next(env.examples(seed)), policy.seeded(seed), group_size)
        finally:
            await client.close()

    rollouts = asyncio.run(main())
    rewards, lengths = [r.reward for r in rollouts], [r.num_completion_tokens for r in rollouts]
    return list(zip(rollouts, group_advantages(rewards, lengths, AdvantageConfig())))
