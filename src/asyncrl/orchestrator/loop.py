"""The orchestrator loop: one batch of rollouts per trainer step, never staler than `max_async_level`.

For step n (1-based) the trainer starts from policy version n - 1. Batch n may only hold rollouts made by
version >= n - 1 - max_async_level. So before generating batch n the orchestrator makes sure inference
serves at least that version (waiting for the trainer to publish it), loading the newest one available.
With max_async_level = 0 that is lockstep; with 1, batch n + 1 is generated while the trainer makes
version n.

Each batch draws its groups from the configured environments by weight (`EnvironmentSampler`); each group's
advantages follow its environment's settings, and metrics are logged per environment label as well.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from asyncrl.config.schema import OrchestratorConfig
from asyncrl.environments import load_environment
from asyncrl.environments.base import Environment, Example, Rollout
from asyncrl.errors import AsyncRLError
from asyncrl.evals.online import OnlineEvals
from asyncrl.loading import load_tokenizer
from asyncrl.metrics import JsonlWriter, MetricsLogger
from asyncrl.orchestrator import checkpoint
from asyncrl.orchestrator.advantages import carries_signal, group_advantages
from asyncrl.orchestrator.client import InferenceClient, ServedPolicy
from asyncrl.orchestrator.packing import Sample, pack
from asyncrl.orchestrator.sampler import EnvironmentSampler
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


Group = tuple[str, list[Rollout]]  # an environment label and the rollouts of one example


def load_environments(cfg: OrchestratorConfig) -> dict[str, Environment]:
    return {label: load_environment(env.name or label, **env.args) for label, env in cfg.environments.items()}


async def generate_batch(
    sampler: EnvironmentSampler, policy: ServedPolicy, cfg: OrchestratorConfig, step: int
) -> list[Group]:
    """All groups of batch `step`, `max_concurrency` groups in flight at a time; group i samples with a seed
    from (seed, step, i), so a resumed run generates what the interrupted one would have."""
    limit = asyncio.Semaphore(cfg.max_concurrency)

    async def one_group(label: str, example: Example, seed: int) -> Group:
        async with limit:
            return label, await sampler.environments[label].rollout_group(example, policy.seeded(seed), cfg.group_size)

    drawn = sampler.draw(cfg.batch_size // cfg.group_size)
    seeds = [checkpoint.group_seed(cfg.seed, step, i) for i in range(len(drawn))]
    return list(await asyncio.gather(*(one_group(label, ex, seed) for (label, ex), seed in zip(drawn, seeds))))


def to_samples(groups: list[Group], cfg: OrchestratorConfig, stats: dict) -> list[Sample]:
    """Advantages per group, by its environment's settings; errored rollouts are left out, groups without
    signal are left out and counted. A rollout of several token samples gives each its advantage."""
    samples = []
    for label, group in groups:
        scored = [r for r in group if r.error is None]
        if not scored:
            continue
        rewards, lengths = [r.reward for r in scored], [r.num_completion_tokens for r in scored]
        advantages = group_advantages(rewards, lengths, cfg.environments[label].advantage)
        if not carries_signal(advantages):
            stats["zero_advantage_groups"] += 1
            continue
        for rollout, advantage in zip(scored, advantages):
            for s in rollout.samples:
                samples.append(
                    Sample(s.input_ids, s.loss_mask, advantage, s.inference_logprobs, cfg.sampling.temperature)
                )
    return samples


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def rollout_metrics(groups: list[Group]) -> dict[str, Any]:
    """Reward and rollout counts over the batch and per environment label (`reward/<label>/mean`, ...)."""
    metrics: dict[str, Any] = {}
    by_label: dict[str, list[Rollout]] = {}
    for label, group in groups:
        by_label.setdefault(label, []).extend(group)
    for prefix, rollouts in [("", [r for _, g in groups for r in g])] + [(f"{k}/", v) for k, v in by_label.items()]:
        rewards = [r.reward for r in rollouts if r.error is None] or [0.0]
        metrics[f"reward/{prefix}mean"] = statistics.fmean(rewards)
        metrics[f"reward/{prefix}std"] = statistics.pstdev(rewards)
        metrics[f"rollouts/{prefix}errored"] = sum(r.error is not None for r in rollouts)
        metrics[f"rollouts/{prefix}truncated"] = sum(r.is_truncated for r in rollouts)
        metrics[f"rollouts/{prefix}prefix_breaks"] = sum(r.prefix_breaks for r in rollouts)
        metrics[f"turns/{prefix}mean"] = _mean([r.turns for r in rollouts])
        if prefix:
            names = {name for r in rollouts for name in r.metrics}
            for name in sorted(names):
                metrics[f"reward/{prefix}{name}"] = _mean([r.metrics[name] for r in rollouts if name in r.metrics])
    return metrics


async def orchestrate(cfg: OrchestratorConfig) -> None:
    output_dir = Path(cfg.output_dir)
    tokenizer = load_tokenizer(cfg.model.name)
    environments = load_environments(cfg)
    # The sampler's state_dict() is all a checkpoint needs to resume the example streams (see sampler.py).
    sampler = EnvironmentSampler(environments, {k: e.weight for k, e in cfg.environments.items()}, cfg.seed)
    client = InferenceClient(cfg.inference_url, cfg.admin_token, cfg.request_timeout)
    policy = ServedPolicy(client, tokenizer, cfg.sampling, cfg.seq_len)
    metrics = MetricsLogger(output_dir, "orchestrator")
    samples_log = JsonlWriter(output_dir / "samples.jsonl")
    evals = OnlineEvals(cfg, client, tokenizer, metrics)
    try:
        served_version = (await client.wait_ready(cfg.wait_timeout))["policy_version"]
        print(f"orchestrator: inference ready at {cfg.inference_url} (policy version {served_version})", flush=True)
        done = 0 if cfg.resume is None else checkpoint.resume(output_dir, cfg.resume.step, sampler).step
        for step in range(done + 1, cfg.max_steps + 1):
            step_start = time.time()
            oldest = min_policy_version(step, cfg.max_async_level)
            waited = await wait_for_version(output_dir, oldest, cfg.wait_timeout)
            newest = weights.latest_version(output_dir)
            if newest > served_version:
                broadcast = cfg.weight_transfer.mode == "broadcast"  # then the folder holds only the marker
                path = None if broadcast else weights.weights_dir(output_dir, newest)
                served_version = await client.update_weights(path, newest)

            generate_start = time.time()
            evals.start(step)  # on the weights of this batch, alongside it (docs/evals.md)
            groups = await generate_batch(sampler, policy, cfg, step)
            generate_end = time.time()
            await evals.finish()

            rollouts = [r for _, g in groups for r in g]
            fresh = [(label, [r for r in g if r.min_policy_version >= oldest]) for label, g in groups]
            dropped = len(rollouts) - sum(len(g) for _, g in fresh)
            stats = {"zero_advantage_groups": 0}
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
                    **rollout_metrics(groups),
                    "seq_len/mean": statistics.fmean(r.num_tokens for r in rollouts),
                    "completion_len/mean": completion_tokens / len(rollouts),
                    "off_policy/mean": statistics.fmean(lags),
                    "off_policy/max": max(lags),
                    "off_policy/dropped": dropped,
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
            for label, r in [(label, g[0]) for label, g in groups if g][: cfg.samples_per_step]:  # one per prompt
                samples_log.write(
                    {
                        "step": step,
                        "env": label,
                        "prompt": r.example.prompt[-1]["content"],
                        "completion": r.completion_text,
                        "answer": r.example.answer,
                        "reward": r.reward,
                        "error": r.error,
                        "turns": r.turns,
                        "conversation": r.messages[len(r.example.prompt) :] if r.turns > 1 else None,
                    }
                )
            print(
                f"orchestrator: step {step} reward {statistics.fmean(rewards):.3f} "
                f"generated {completion_tokens} tokens in {generate_end - generate_start:.2f}s "
                f"(policy version {served_version})",
                flush=True,
            )
            if cfg.ckpt.interval and step % cfg.ckpt.interval == 0:
                progress = checkpoint.OrchestratorProgress(step, served_version, sampler.state_dict())
                checkpoint.save(output_dir, progress)
    finally:
        await client.close()


def run_orchestrator(cfg: OrchestratorConfig) -> int:
    asyncio.run(orchestrate(cfg))
    return 0
