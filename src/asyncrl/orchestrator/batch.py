"""Cutting trainer batches from the queue, and what a batch becomes: packed samples and its metrics.

Batch n may only hold rollouts whose every token came from policy version >= n - 1 - max_async_level.
So before batch n is cut, older rollouts leave the queue (counted as dropped); then the batch takes whole
groups from the front until it holds `batch_size` rollouts (or `batch_tokens` tokens). Its groups are put
in the order they were drawn, so that a batch's contents, not the order its groups happened to finish in,
decide what the trainer sees.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from asyncrl.environments.base import Rollout
from asyncrl.orchestrator.packing import Sample
from asyncrl.orchestrator.queue import RolloutQueue, ScoredGroup


def min_policy_version(step: int, max_async_level: int) -> int:
    """The oldest policy version batch `step` may contain."""
    return max(0, step - 1 - max_async_level)


@dataclass
class Batch:
    step: int
    groups: list[ScoredGroup]  # in the order they were drawn
    dropped: int  # rollouts left out of the queue as too old while this batch was waited for

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.rollouts]

    def samples(self, temperature: float) -> list[Sample]:
        """The packed samples: every token sample of every scored rollout of a group that carries signal,
        with its rollout's advantage. Errored rollouts and groups with all-equal rewards add nothing."""
        samples = []
        for group in self.groups:
            if not group.carries_signal:
                continue
            for rollout, advantage in zip(group.rollouts, group.advantages):
                if rollout.error is not None:
                    continue
                for s in rollout.samples:
                    samples.append(
                        Sample(s.input_ids, s.loss_mask, advantage, s.inference_logprobs, temperature, s.routed_experts)
                    )
        return samples


class BatchCutter:
    """Decides when the queue holds a batch, and cuts it."""

    def __init__(self, batch_size: int, batch_tokens: int | None, max_async_level: int):
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens
        self.max_async_level = max_async_level
        self._dropped = 0  # since the last cut

    def cut(self, queue: RolloutQueue, step: int) -> Batch | None:
        """Batch `step`, or None while the queue (rid of rollouts too old for it) holds too little."""
        self._dropped += queue.drop_older_than(min_policy_version(step, self.max_async_level))
        groups = queue.take(self.batch_size, self.batch_tokens)
        if groups is None:
            return None
        batch = Batch(step, sorted(groups, key=lambda g: g.index), self._dropped)
        self._dropped = 0
        return batch


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def rollout_metrics(groups: list[tuple[str, list[Rollout]]]) -> dict[str, Any]:
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


def batch_metrics(batch: Batch, num_samples: int) -> dict[str, Any]:
    """What the orchestrator logs about the rollouts of one batch."""
    rollouts = batch.rollouts
    lags = [(batch.step - 1) - r.min_policy_version for r in rollouts if r.policy_versions] or [0]
    return {
        **rollout_metrics([(g.label, g.rollouts) for g in batch.groups]),
        "seq_len/mean": _mean([r.num_tokens for r in rollouts]),
        "completion_len/mean": _mean([r.num_completion_tokens for r in rollouts]),
        "off_policy/mean": statistics.fmean(lags),
        "off_policy/max": max(lags),
        "off_policy/dropped": batch.dropped,
        "off_policy/mixed_versions": sum(r.max_policy_version != r.min_policy_version for r in rollouts),
        "batch/rollouts": len(rollouts),
        "batch/groups": len(batch.groups),
        "batch/zero_advantage_groups": sum(not g.carries_signal for g in batch.groups),
        "batch/samples": num_samples,
        "batch/tokens": sum(r.num_tokens for r in rollouts),
        "prefix_cache/prompt_tokens": (prompt := sum(r.prompt_tokens for r in rollouts)),
        "prefix_cache/cached_tokens": (cached := sum(r.cached_tokens for r in rollouts)),
        "prefix_cache/hit_rate": cached / prompt if prompt else 0.0,
    }
