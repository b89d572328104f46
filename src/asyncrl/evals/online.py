"""Online evals during `asyncrl rl`: every `eval.interval` steps, the held-out examples of each environment.

The eval of step n starts when the orchestrator starts waiting for batch n, on the weights the servers
hold then, and runs alongside the training rollouts: its requests go to the least-loaded server of the
pool and share its decoding batches instead of queueing behind them. It never holds a batch back, and its
rollouts never enter one, so the off-policy accounting is untouched. Evals run one after the other: one that
is due while the previous one still runs starts when that one ends. The run ends once every eval that was
due has ended. Metrics go to metrics.jsonl with source orchestrator,
one line per eval, logged when it ends: `eval/<label>/avg@n`, `eval/<label>/pass@k`,
`eval/<label>/errored`, `eval/<label>/truncated`, `eval/<label>/mean/<name>`, `eval/policy_version` (the
oldest version among its tokens; weights may go live while it runs), `eval/time`.
"""

from __future__ import annotations

import asyncio
import time

from asyncrl.config.schema import EvalEnvironmentConfig, OrchestratorConfig
from asyncrl.environments.base import Policy
from asyncrl.evals.metrics import summarize
from asyncrl.evals.routes import TokenRoute
from asyncrl.evals.run import evaluate, load_eval_environments
from asyncrl.metrics import MetricsLogger

LOGGED = ("avg@", "pass@", "errored", "truncated", "mean/")  # per-environment summary keys that become metrics


def online_eval_environments(cfg: OrchestratorConfig) -> dict[str, EvalEnvironmentConfig]:
    """The environments `asyncrl rl` evaluates: `[orchestrator.eval.environments]`, or the training ones when
    it is empty. An eval entry without a name whose label is a training environment's is that environment:
    its name and args, the entry's own args on top (`vowels = { num_examples = 64 }` evaluates `vowels`)."""
    if not cfg.eval.environments:
        return {label: EvalEnvironmentConfig(name=env.name, args=env.args) for label, env in cfg.environments.items()}
    resolved = {}
    for label, entry in cfg.eval.environments.items():
        training = cfg.environments.get(label)
        if entry.name is None and training is not None:
            entry = entry.model_copy(update={"name": training.name or label, "args": {**training.args, **entry.args}})
        resolved[label] = entry
    return resolved


class OnlineEvals:
    def __init__(self, cfg: OrchestratorConfig, policy: Policy, metrics: MetricsLogger):
        self.suite = cfg.eval
        self.metrics = metrics
        self.task: asyncio.Task | None = None  # the evals due so far, one after the other
        self.env_cfgs = online_eval_environments(cfg)
        self.envs = load_eval_environments(self.env_cfgs) if self.suite.interval else {}
        self.route = TokenRoute(policy)

    def start(self, step: int) -> None:
        """Start the eval of `step` when one is due (steps 1, 1 + interval, ...), after the one before it."""
        if not self.suite.interval or (step - 1) % self.suite.interval != 0:
            return
        if self.task is not None and self.task.done():
            self.task.result()  # an eval that failed stops the run here
        self.task = asyncio.create_task(self._after(self.task, step))

    async def _after(self, previous: asyncio.Task | None, step: int) -> None:
        if previous is not None:
            await previous
        await self._run(step)

    async def finish(self, timeout: float) -> None:
        """Wait for every eval that was started; their metrics are logged as each ends."""
        if self.task is not None:
            task, self.task = self.task, None
            await asyncio.wait_for(task, timeout)

    async def _run(self, step: int) -> None:
        start = time.time()
        record: dict[str, float] = {}
        versions = []
        for label, env in self.envs.items():
            samples = await evaluate(env, label, self.env_cfgs[label], self.suite, self.route)
            summary = summarize(samples, self.suite.samples_per_example, self.suite.pass_ks)
            record |= {f"eval/{label}/{key}": value for key, value in summary.items() if key.startswith(LOGGED)}
            versions += [s.policy_version for s in samples if s.policy_version is not None]
        record["eval/policy_version"] = min(versions, default=0)
        record["eval/time"] = time.time() - start
        self.metrics.log(step, record)
        n = self.suite.samples_per_example
        scores = ", ".join(f"{label} avg@{n} {record[f'eval/{label}/avg@{n}']:.3f}" for label in self.envs)
        print(f"orchestrator: eval at step {step}: {scores}", flush=True)
