"""The rollout queue and the batch cutter: whole groups, oldest first, rollouts too old for a batch dropped and
counted, a batch's groups in the order they were drawn; and a checkpoint's copy of a queued group."""

from __future__ import annotations

import json

from asyncrl.environments.base import Example, Rollout, TokenSample
from asyncrl.orchestrator.batch import BatchCutter, batch_metrics, min_policy_version
from asyncrl.orchestrator.checkpoint import decode_group, encode_group
from asyncrl.orchestrator.queue import RolloutQueue, ScoredGroup


def rollout(version: int, reward: float = 0.0, newest: int | None = None, tokens: int = 4) -> Rollout:
    sample = TokenSample(list(range(tokens)), [False] + [True] * (tokens - 1), [0.0] + [-0.5] * (tokens - 1))
    versions = [version] * (tokens - 2) + [version if newest is None else newest]
    return Rollout(
        Example([{"role": "user", "content": "hi"}], "ok"), [sample], [], versions, "", "stop", reward=reward
    )


def group(index: int, version: int, size: int = 2, rewards: list[float] | None = None) -> ScoredGroup:
    rewards = rewards or [float(i) for i in range(size)]
    rollouts = [rollout(version, r) for r in rewards]
    mean = sum(rewards) / len(rewards)
    return ScoredGroup(index, "env", rollouts[0].example, rollouts, [r - mean for r in rewards])


def test_oldest_version_a_batch_may_hold():
    assert [min_policy_version(n, 1) for n in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [min_policy_version(n, 0) for n in (1, 2, 3)] == [0, 1, 2]


def test_a_batch_waits_for_enough_rollouts_and_takes_whole_groups():
    queue = RolloutQueue([group(0, 0)])
    cutter = BatchCutter(batch_size=4, batch_tokens=None, max_async_level=1)
    assert cutter.cut(queue, 1) is None and len(queue) == 1
    queue.put(group(2, 0))
    queue.put(group(1, 0))
    batch = cutter.cut(queue, 1)
    assert [g.index for g in batch.groups] == [0, 2]  # whole groups, from the front
    assert [g.index for g in queue] == [1]


def test_groups_of_a_batch_come_in_the_order_they_were_drawn():
    queue = RolloutQueue([group(5, 0), group(3, 0)])
    batch = BatchCutter(4, None, 1).cut(queue, 1)
    assert [g.index for g in batch.groups] == [3, 5]


def test_rollouts_too_old_for_the_batch_are_dropped_and_counted():
    queue = RolloutQueue([group(0, 0), group(1, 1), group(2, 2), group(3, 2)])
    cutter = BatchCutter(batch_size=4, batch_tokens=None, max_async_level=0)
    batch = cutter.cut(queue, 3)  # batch 3 at level 0 takes version 2 only
    assert batch.dropped == 4
    assert [g.index for g in batch.groups] == [2, 3]
    assert all(r.min_policy_version == 2 for r in batch.rollouts)


def test_drops_while_waiting_are_counted_in_the_batch_that_is_cut():
    queue = RolloutQueue([group(0, 0)])
    cutter = BatchCutter(batch_size=4, batch_tokens=None, max_async_level=0)
    assert cutter.cut(queue, 2) is None  # drops the version-0 group, still too little
    queue.put(group(1, 1))
    queue.put(group(2, 1))
    assert cutter.cut(queue, 2).dropped == 2


def test_a_rollout_with_any_token_too_old_is_dropped_alone():
    g = group(0, 1, rewards=[0.0, 1.0])
    g.rollouts[0].policy_versions[0] = 0  # its first turn was sampled before the weights changed
    queue = RolloutQueue([g])
    assert queue.drop_older_than(1) == 1
    assert [r.reward for r in g.rollouts] == [1.0] and g.advantages == [0.5]


def test_a_rollout_without_a_sampled_token_is_never_too_old():
    """An episode that ended before its first answer (no room, no time) was sampled by no version: it stays,
    and adds no lag, so that such batches are cut (and a run of them stopped) instead of waiting forever."""
    unanswered = ScoredGroup(0, "env", group(0, 0).example, [rollout(0), rollout(0)], [0.0, 0.0])
    for r in unanswered.rollouts:
        r.policy_versions = []
    batch = BatchCutter(batch_size=2, batch_tokens=None, max_async_level=1).cut(RolloutQueue([unanswered]), 5)
    assert batch is not None and batch.dropped == 0
    assert batch_metrics(batch, 0)["off_policy/max"] == 0


def test_a_batch_can_be_cut_by_tokens():
    queue = RolloutQueue([group(0, 0), group(1, 0), group(2, 0)])  # 8 tokens a group
    cutter = BatchCutter(batch_size=64, batch_tokens=12, max_async_level=1)
    batch = cutter.cut(queue, 1)
    assert [g.index for g in batch.groups] == [0, 1] and len(queue) == 1


def test_samples_leave_out_errored_rollouts_and_groups_without_signal():
    flat = group(0, 0, rewards=[1.0, 1.0])
    mixed = group(1, 0, rewards=[0.0, 1.0])
    mixed.rollouts.append(rollout(0))
    mixed.rollouts[-1].error = "reward raised"
    mixed.advantages.append(0.0)
    batch = BatchCutter(4, None, 1).cut(RolloutQueue([flat, mixed]), 1)
    samples = batch.samples(temperature=0.7)
    assert [s.advantage for s in samples] == [-0.5, 0.5]
    assert {s.temperature for s in samples} == {0.7}
    metrics = batch_metrics(batch, len(samples))
    assert metrics["batch/zero_advantage_groups"] == 1 and metrics["rollouts/errored"] == 1
    assert metrics["batch/rollouts"] == 5


def test_batch_metrics_report_lag_and_rollouts_that_span_versions():
    g = group(0, 1)
    g.rollouts[1] = rollout(1, newest=2)
    batch = BatchCutter(2, None, 1).cut(RolloutQueue([g]), 3)
    metrics = batch_metrics(batch, 2)
    assert metrics["off_policy/max"] == 1 and metrics["off_policy/mean"] == 1
    assert metrics["off_policy/mixed_versions"] == 1


def test_a_queued_group_survives_a_checkpoint_whole():
    g = group(7, 3, rewards=[0.25, 1.0])
    g.rollouts[0].metrics = {"exact": 0.0}
    g.dispatched_at, g.finished_at, g.server = 1.5, 2.5, "http://127.0.0.1:9"
    back = decode_group(json.loads(json.dumps(encode_group(g))))
    assert back.index == 7 and back.label == "env" and back.advantages == g.advantages
    assert back.server == g.server and back.finished_at == 2.5
    for before, after in zip(g.rollouts, back.rollouts):
        assert after.samples == before.samples and after.policy_versions == before.policy_versions
        assert (after.reward, after.metrics, after.example.prompt) == (
            before.reward,
            before.metrics,
            before.example.prompt,
        )
