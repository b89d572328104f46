"""The orchestrator loop: one batch of rollouts per trainer step, never staler than `max_async_level`.

For step n (1-based) the trainer starts from policy version n - 1. Batch n may only hold rollouts made by
version >= n - 1 - max_async_level. So before generating batch n the orchestrator makes sure inference
serves at least that version (waiting for the trainer to publish it), loading the newest one available.
With max_async_level = 0 that is lockstep; with 1, batch n + 1 is generated while the trainer makes
version n.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from pathlib import Path

from asyncrl.config.schema import OrchestratorConfig
from asyncrl.environments import load_environment
from asyncrl.environments.base import Environment, Example, Rollout
from asyncrl.errors import AsyncRLError
from asyncrl.loading import load_tokenizer
from asyncrl.metrics import JsonlWriter, MetricsLogger
from asyncrl.orchestrator.advantages import carries_signal, grpo_advantages
from asyncrl.orchestrator.client import InferenceClient, ServedPolicy
from asyncrl.orchestrator.packing import Sample, pack
from asyncrl.transport import rollouts as rollout_files
from asyncrl.transport import weights


def min_policy_version(step: int, max_async_level: int) -> int:
    """The oldest policy version batch `step` may contain."""
    return max(0, step - 1 - max_async_level)


async def wait_for_version(output_dir: Path, version: int, timeout: float) -> float:
    """Wait until the trainer has published `version`; returns the seconds waited."""
    start = time.monotonic()
    while weights.latest_version(output_dir) < version:
        if time.monotonic() - start > timeout:
            raise AsyncRLError(
                f"timed out after {timeout:.0f}s waiting for trainer weights of step {version} "
                f"in {weights.weights_dir(output_dir, version)} (is the trainer running?)"
            )
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def generate_batch(
    env: Environment, examples, policy: ServedPolicy, cfg: OrchestratorConfig
) -> list[list[Rollout]]:
    """All groups of one batch, `max_concurrency` groups in flight at a time."""
    limit = asyncio.Semaphore(cfg.max_concurrency)

    async def one_group(example: Example) -> list[Rollout]:
        async with limit:
            return await env.rollout_group(example, policy, cfg.group_size)

    batch_examples = list(itertools.islice(examples, cfg.batch_size // cfg.group_size))
    return list(await asyncio.gather(*(one_group(e) for e in batch_examples)))


def to_samples(groups: list[list[Rollout]], cfg: OrchestratorConfig, stats: dict) -> list[Sample]:
    """Advantages per group; errored rollouts and groups without signal are left out and counted."""
    samples = []
    for group in groups:
        scored = [r for r in group if r.error is None]
        stats["errored"] += len(group) - len(scored)
        if not scored:
            continue
        advantages = grpo_advantages([r.reward for r in scored], cfg.std_normalize)
        if not carries_signal(advantages):
            stats["zero_advantage_groups"] += 1
            continue
        for rollout, advantage in zip(scored, advantages):
            samples.append(
                Sample(
                    rollout.input_ids,
                    rollout.loss_mask,
                    advantage,
                    rollout.inference_logprobs,
                    cfg.sampling.temperature,
                )
            )
    return samples


async def orchestrate(cfg: OrchestratorConfig) -> None:
    output_dir = Path(cfg.output_dir)
    tokenizer = load_tokenizer(cfg.model.name)
    env = load_environment(cfg.environment.name, **cfg.environment.args)
    examples = env.examples(cfg.seed)
    client = InferenceClient(cfg.inference_url, cfg.admin_token, cfg.request_timeout)
    policy = ServedPolicy(client, tokenizer, cfg.sampling)
    metrics = MetricsLogger(output_dir, "orchestrator")
    samples_log = JsonlWriter(output_dir / "samples.jsonl")
    try:
        served_version = (await client.wait_ready(cfg.wait_timeout))["policy_version"]
        print(f"orchestrator: inference ready at {cfg.inference_url} (policy version {served_version})", flush=True)
        for step in range(1, cfg.max_steps + 1):
            step_start = time.time()
            oldest = min_policy_version(step, cfg.max_async_level)
            waited = await wait_for_version(output_dir, oldest, cfg.wait_timeout)
            newest = weights.latest_version(output_dir)
            if newest > served_version:
                served_version = await client.update_weights(weights.weights_dir(output_dir, newest), newest)

            generate_start = time.time()
            groups = await generate_batch(env, examples, policy, cfg)
            generate_end = time.time()

            rollouts = [r for g in groups for r in g]
            fresh = [[r for r in g if r.min_policy_version >= oldest] for g in groups]
            dropped = len(rollouts) - sum(len(g) for g in fresh)
            stats = {"errored": 0, "zero_advantage_groups": 0}
            samples = to_samples(fresh, cfg, stats)
            per_rank = pack(samples, cfg.seq_len, cfg.num_trainer_ranks, tokenizer.pad_token_id or 0)
            for rank, micro_batches in enumerate(per_rank):
                rollout_files.write_batch(
                    rollout_files.rank_file(output_dir, step, rank), micro_batches, {"step": step}
                )

            rewards = [r.reward for r in rollouts if r.error is None] or [0.0]
            lags = [(step - 1) - r.min_policy_version for r in rollouts]
            completion_tokens = sum(r.num_completion_tokens for r in rollouts)
            metrics.log(
                step,
                {
                    "reward/mean": statistics.fmean(rewards),
                    "reward/std": statistics.pstdev(rewards),
                    **{
                        f"reward/{k}": statistics.fmean(r.metrics.get(k, 0.0) for r in rollouts)
                        for k in rollouts[0].metrics
                    },
                    "seq_len/mean": statistics.fmean(len(r.input_ids) for r in rollouts),
                    "completion_len/mean": completion_tokens / len(rollouts),
                    "off_policy/mean": statistics.fmean(lags),
                    "off_policy/max": max(lags),
                    "off_policy/dropped": dropped,
                    "rollouts/errored": stats["errored"],
                    "batch/zero_advantage_groups": stats["zero_advantage_groups"],
                    "batch/samples": len(samples),
                    "policy_version": served_version,
                    "perf/generate_tokens_per_s": completion_tokens / max(generate_end - generate_start, 1e-9),
                    "time/step": time.time() - step_start,
                    "time/generate": generate_end - generate_start,
                    "time/wait_for_weights": waited,
                    "timestamp/generate_start": generate_start,
                    "timestamp/generate_end": generate_end,
                },
            )
            for r in [g[0] for g in groups if g][: cfg.samples_per_step]:  # one per prompt
                samples_log.write(
                    {
                        "step": step,
                        "prompt": r.example.prompt[-1]["content"],
                        "completion": r.completion_text,
                        "answer": r.example.answer,
                        "reward": r.reward,
                        "error": r.error,
                    }
                )
            print(
                f"orchestrator: step {step} reward {statistics.fmean(rewards):.3f} "
                f"generated {completion_tokens} tokens in {generate_end - generate_start:.2f}s "
                f"(policy version {served_version})",
                flush=True,
            )
    finally:
        await client.close()


def run_orchestrator(cfg: OrchestratorConfig) -> int:
    asyncio.run(orchestrate(cfg))
    return 0
