"""Online evals during `asyncrl rl`: every `eval.interval` steps, the held-out examples of each environment.

An eval of step n starts together with batch n's generation and must end before batch n goes to the
trainer. So it runs on the same weights as batch n (the orchestrator only changes weights between
batches), it shares the server's decoding batches with the training rollouts instead of queueing behind
them, and it delays the trainer only by the time it takes beyond the batch. Its rollouts never enter a
batch, so the off-policy accounting is untouched. Metrics go to metrics.jsonl with source orchestrator, one
line per eval before the training line of its step: `eval/<label>/avg@n`, `eval/<label>/pass@k`,
`eval/<label>/errored`, `eval/<label>/truncated`, `eval/<label>/mean/<name>`, `eval/policy_version`,
`eval/time`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from asyncrl.config.schema import EvalEnvironmentConfig, OrchestratorConfig
from asyncrl.evals.metrics import summarize
from asyncrl.evals.routes import TokenRoute
from asyncrl.evals.run import evaluate, load_eval_environments
from asyncrl.metrics import MetricsLogger
from asyncrl.orchestrator.client import InferenceClient, ServedPolicy

LOGGED = ("avg@", "pass@", "errored", "truncated", "mean/")  # per-environment summary keys that become metrics


class OnlineEvals:
    def __init__(self, cfg: OrchestratorConfig, client: InferenceClient, tokenizer: Any, metrics: MetricsLogger):
        self.suite = cfg.eval
        self.metrics = metrics
        self.task: asyncio.Task | None = None
        self.env_cfgs = self.suite.environments or {
            label: EvalEnvironmentConfig(name=env.name, args=env.args) for label, env in cfg.environments.items()
        }
        self.envs = load_eval_environments(self.env_cfgs) if self.suite.interval else {}
        self.route = TokenRoute(ServedPolicy(client, tokenizer, cfg.sampling, cfg.seq_len))

    def start(self, step: int) -> None:
        """Start the eval of `step` when one is due (steps 1, 1 + interval, ...)."""
        if self.suite.interval and (step - 1) % self.suite.interval == 0:
            self.task = asyncio.create_task(self._run(step))

    async def finish(self) -> None:
        """Wait for the eval started with this batch, if any; its metrics are logged when it ends."""
        if self.task is not None:
            task, self.task = self.task, None
            await task

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
