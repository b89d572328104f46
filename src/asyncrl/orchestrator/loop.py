"""The orchestrator: rollouts stream through the inference pool into a queue, and trainer batches are cut
from the queue as soon as it holds one.

    dispatcher (continuous)    examples → groups in flight on the pool → scored, with advantages → queue
    weight follower            new trainer weights → every server, while its requests stay in flight
    health watch               a server that stops answering is marked down; its groups go elsewhere
    batch loop (below)         for step n: wait until the queue holds batch n → write rollouts/step_n →
                               log → checkpoint every ckpt.interval steps

Trainer step n starts from policy version n - 1; batch n may only hold rollouts whose every token was
made by version >= n - 1 - max_async_level (the dispatcher keeps to that, the batch cutter enforces it).
Each batch draws its groups from the configured environments by weight (`EnvironmentSampler`); each group's
advantages follow its environment's settings, and metrics are logged per environment label as well.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config.schema import OrchestratorConfig
from asyncrl.env_server.remote import environment_from_config
from asyncrl.environments.base import Environment
from asyncrl.errors import AsyncRLError
from asyncrl.evals.online import OnlineEvals
from asyncrl.loading import load_tokenizer
from asyncrl.metrics import JsonlWriter, MetricsLogger
from asyncrl.orchestrator import checkpoint
from asyncrl.orchestrator.batch import Batch, BatchCutter, batch_metrics
from asyncrl.orchestrator.client import ServedPolicy
from asyncrl.orchestrator.dispatcher import Dispatcher, GroupTicket
from asyncrl.orchestrator.loop_lag import EventLoopLag
from asyncrl.orchestrator.notify import Notifier
from asyncrl.orchestrator.packing import pack
from asyncrl.orchestrator.pool import InferencePool, PooledPolicy
from asyncrl.orchestrator.queue import RolloutQueue
from asyncrl.orchestrator.sample_log import sample_record
from asyncrl.orchestrator.sampler import EnvironmentSampler
from asyncrl.preflight import check_prompt_lengths
from asyncrl.step_profiler import StepProfiler
from asyncrl.transport import rollouts as rollout_files
from asyncrl.transport.transfer import update_source

# Batches in a row without one sampled token before the run stops: nothing can be learned from them.
EMPTY_BATCHES_LIMIT = 3


def load_environments(cfg: OrchestratorConfig) -> dict[str, Environment]:
    """The run's environments by label: in this process, or served by env-servers (docs/environments.md)."""
    return {label: environment_from_config(label, env) for label, env in cfg.environments.items()}


async def next_batch(
    step: int, cutter: BatchCutter, dispatcher: Dispatcher, background: list[asyncio.Task], timeout: float
) -> Batch:
    """Wait until the queue holds batch `step`. A background task that fails stops the wait with its error;
    so does `timeout` seconds without any group finishing."""
    progress, deadline = None, 0.0
    while True:
        for task in background:
            if task.done():
                raise task.exception() or AsyncRLError(f"orchestrator task {task.get_name()} stopped")
        dispatcher.pool.check_servers()
        if dispatcher.pool.error is not None:
            raise dispatcher.pool.error
        batch = cutter.cut(dispatcher.queue, step)
        if batch is not None:
            return batch
        state = (len(dispatcher.queue), dispatcher.queue.rollouts, sorted(dispatcher.inflight))
        if state != progress:
            progress, deadline = state, time.monotonic() + timeout
        elif time.monotonic() > deadline:
            raise AsyncRLError(f"batch {step} not ready after {timeout:.0f}s without progress: {dispatcher.describe()}")
        await dispatcher.notifier.wait(1.0)


@dataclass(frozen=True)
class WrittenBatch:
    samples: int
    pack_seconds: float  # building the trainer's rows: token samples, then micro-batches per rank
    write_seconds: float  # writing the rank files


async def write_batch(batch: Batch, cfg: OrchestratorConfig, pad_token_id: int) -> WrittenBatch:
    """Pack batch n into rollouts/step_n/rank_R.safetensors, one file per trainer rank.
    In a thread: a large batch takes seconds of Python to pack and write, which on the event loop would hold
    up every episode in flight (groups keep finishing while it is written, none is touched by it)."""

    def pack_and_write() -> WrittenBatch:
        start = time.perf_counter()
        samples = batch.samples(cfg.sampling.temperature)
        ranks = pack(samples, cfg.seq_len, cfg.num_trainer_ranks, pad_token_id)
        packed = time.perf_counter()
        for rank, micro_batches in enumerate(ranks):
            path = rollout_files.rank_file(cfg.output_dir, batch.step, rank)
            rollout_files.write_batch(path, micro_batches, {"step": batch.step})
        return WrittenBatch(len(samples), packed - start, time.perf_counter() - packed)

    return await asyncio.to_thread(pack_and_write)


def log_samples(batch: Batch, log: JsonlWriter, count: int, tokenizer) -> None:
    """The first rollout of the batch's first `count` groups, token by token, to samples.jsonl."""
    for group in batch.groups[:count]:
        rollout, advantage = group.rollouts[0], group.advantages[0]
        trained = group.carries_signal and rollout.error is None
        log.write(
            sample_record(batch.step, group.label, rollout, advantage if trained else None, tokenizer, group.index)
        )


async def orchestrate(cfg: OrchestratorConfig) -> None:
    output_dir = Path(cfg.output_dir)
    tokenizer = load_tokenizer(cfg.model.name)
    environments = load_environments(cfg)
    for warning in check_prompt_lengths(environments, tokenizer, cfg):
        print(f"orchestrator: warning: {warning}", flush=True)
    # The sampler's state_dict() is all a checkpoint needs to resume the example streams (see sampler.py).
    sampler = EnvironmentSampler(environments, {k: e.weight for k, e in cfg.environments.items()}, cfg.seed)
    notifier = Notifier()
    pool = InferencePool(
        cfg.inference_urls, cfg.admin_token, cfg.request_timeout, cfg.server_timeout, notifier, cfg.inference_api_key,
        cfg.server_failures_before_down, cfg.no_server_timeout,
    )  # fmt: skip
    metrics = MetricsLogger(output_dir, "orchestrator")
    samples_log = JsonlWriter(output_dir / "samples.jsonl")
    background: list[asyncio.Task] = []
    dispatcher = evals = None
    try:
        await pool.wait_ready(cfg.wait_timeout)
        versions = ", ".join(f"{s.url} (policy version {s.version})" for s in pool.servers)
        print(f"orchestrator: inference ready at {versions}", flush=True)

        done, queue, next_group, pending, floor = 0, RolloutQueue(), 0, [], 0
        if cfg.resume is not None:
            progress = checkpoint.resume(output_dir, cfg.resume.step, sampler)
            done, next_group, floor = progress.step, progress.next_group, progress.policy_version
            queue = RolloutQueue([checkpoint.decode_group(g) for g in progress.queue])
            pending = [
                GroupTicket(
                    p.index, p.label, checkpoint.decode_example(p.example), checkpoint.group_seed(cfg.seed, p.index)
                )
                for p in progress.pending
            ]
        policies = {
            s.index: ServedPolicy(s.client, tokenizer, cfg.sampling, cfg.seq_len, cfg.router_replay)
            for s in pool.servers
        }
        dispatcher = Dispatcher(
            cfg, pool, environments, sampler, lambda s: policies[s.index], queue, notifier, done, next_group, pending,
            floor,
        )  # fmt: skip
        cutter = BatchCutter(cfg.batch_size, cfg.batch_tokens, cfg.max_async_level)
        evals = OnlineEvals(cfg, PooledPolicy(pool, tokenizer, cfg.sampling, cfg.seq_len), metrics)
        lag = EventLoopLag()
        background = [
            asyncio.create_task(lag.run(), name="event loop lag"),
            asyncio.create_task(
                pool.follow_weights(output_dir, update_source(cfg.weight_transfer, output_dir)), name="weight follower"
            ),
            asyncio.create_task(pool.watch_health(), name="health watch"),
            asyncio.create_task(dispatcher.run(), name="dispatcher"),
        ]
        last_cut, empty = time.time(), 0
        profiler = StepProfiler(cfg.profile, "orchestrator", python_calls=True)
        for step in range(done + 1, cfg.max_steps + 1):
            evals.start(step)  # alongside the rollouts of this batch, on the weights the servers hold now
            waiting = time.perf_counter()
            batch = await next_batch(step, cutter, dispatcher, background, cfg.wait_timeout)
            waited = time.perf_counter() - waiting
            cut_at = time.time()
            dispatcher.batch_cut(step)
            written = await write_batch(batch, cfg, tokenizer.pad_token_id or 0)

            pool_stats = pool.take_stats()
            generated = sum(
                v for k, v in pool_stats.items() if k.startswith("perf/server/") and k.endswith("tokens_per_s")
            )
            first_sent = min(g.dispatched_at for g in batch.groups) if batch.groups else cut_at
            record = {
                **batch_metrics(batch, written.samples),
                **dispatcher.take_stats(),
                **pool_stats,
                **lag.take_stats(),
                "queue/rollouts": queue.rollouts,
                "queue/groups": len(queue),
                "policy_version": pool_stats["pool/oldest_version"],
                "perf/generate_tokens_per_s": generated,
                "time/step": cut_at - last_cut,
                "time/generate": cut_at - first_sent,
                "time/wait_for_rollouts": waited,
                "time/score": sum(r.score_seconds for r in batch.rollouts),
                "time/pack": written.pack_seconds,
                "time/write": written.write_seconds,
                "timestamp/generate_start": first_sent,
                "timestamp/generate_end": cut_at,
            }
            metrics.log(step, record)
            await asyncio.to_thread(log_samples, batch, samples_log, cfg.samples_per_step, tokenizer)
            sampled = [r for r in batch.rollouts if r.policy_versions] or batch.rollouts
            print(
                f"orchestrator: step {step} reward {record['reward/mean']:.3f} from {len(batch.groups)} groups "
                f"(policy versions {min(r.min_policy_version for r in sampled)}-"
                f"{max(r.max_policy_version for r in sampled)}, {batch.dropped} dropped), "
                f"{record['queue/rollouts']} queued, {len(dispatcher.inflight)} groups in flight",
                flush=True,
            )
            last_cut = cut_at
            empty = 0 if any(r.num_completion_tokens for r in batch.rollouts) else empty + 1
            if empty == EMPTY_BATCHES_LIMIT:
                raise AsyncRLError(
                    f"batches {step - empty + 1}-{step} hold no sampled token: every rollout ended before its first "
                    f"answer (prompts as long as seq_len = {cfg.seq_len}, or an environment's max_tokens or "
                    "time_limit too small), so the trainer would learn nothing; raise seq_len"
                )
            if cfg.ckpt.interval and step % cfg.ckpt.interval == 0:
                saved = checkpoint.OrchestratorProgress(
                    step,
                    record["policy_version"],
                    sampler.state_dict(),
                    dispatcher.next_index,
                    [checkpoint.pending_group(t.index, t.label, t.example) for t in dispatcher.pending()],
                )
                await asyncio.to_thread(checkpoint.save, output_dir, saved, list(queue))
            profiler.step()
        profiler.stop()
        await evals.finish(cfg.wait_timeout)
    finally:
        groups = [t.task for t in dispatcher.inflight.values()] if dispatcher is not None else []
        if evals is not None and evals.task is not None:
            groups.append(evals.task)
        for task in [*background, *groups]:
            task.cancel()
        await asyncio.gather(*background, *groups, return_exceptions=True)
        await pool.close()


def run_orchestrator(cfg: OrchestratorConfig) -> int:
    asyncio.run(orchestrate(cfg))
    return 0
