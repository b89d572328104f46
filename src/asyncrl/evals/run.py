"""Playing environments' held-out examples through a route and collecting their samples: what `asyncrl eval`
(eval_command.py) and the online evals of `asyncrl rl` (online.py) both run."""

from __future__ import annotations

import asyncio
import itertools

from asyncrl.config.schema import EvalEnvironmentConfig, EvalSuiteConfig
from asyncrl.environments import load_environment
from asyncrl.environments.base import Environment
from asyncrl.evals.metrics import EvalSample
from asyncrl.evals.routes import ChatRoute, TokenRoute
from asyncrl.progress import ProgressBar


def load_eval_environments(environments: dict[str, EvalEnvironmentConfig]) -> dict[str, Environment]:
    return {label: load_environment(env.name or label, **env.args) for label, env in environments.items()}


async def evaluate(
    env: Environment,
    label: str,
    env_cfg: EvalEnvironmentConfig,
    suite: EvalSuiteConfig,
    route: TokenRoute | ChatRoute,
    bar: ProgressBar | None = None,
) -> list[EvalSample]:
    """n samples of each of the environment's first `num_examples` eval examples, `max_concurrency`
    examples in flight; `bar` advances by one per example played."""
    limit = asyncio.Semaphore(suite.max_concurrency)
    examples = itertools.islice(env.eval_examples(), env_cfg.num_examples)

    async def one(index: int, example) -> list[EvalSample]:
        async with limit:
            played = await route.play(env, label, index, example, suite.samples_per_example, env_cfg.pass_threshold)
        if bar is not None:
            bar.advance()
        return played

    groups = await asyncio.gather(*(one(i, e) for i, e in enumerate(examples)))
    return [s for group in groups for s in group]
