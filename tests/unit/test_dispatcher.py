"""Continuous dispatch, replayed without servers: an environment whose groups finish when the test says so,
and a pool whose servers' versions and health the test sets. What is checked is the dispatcher's own
decisions: how much it sends under the off-policy bound, which server a group goes to, what it cancels when
a batch is cut, what it sends again when a server goes down."""

from __future__ import annotations

import asyncio
import itertools

from asyncrl.config import OrchestratorConfig
from asyncrl.environments.base import Environment, Example, Rollout, TokenSample
from asyncrl.environments.rubric import Rubric
from asyncrl.orchestrator.batch import BatchCutter
from asyncrl.orchestrator.dispatcher import Dispatcher, dispatch_room
from asyncrl.orchestrator.notify import Notifier
from asyncrl.orchestrator.pool import InferencePool
from asyncrl.orchestrator.queue import RolloutQueue
from asyncrl.orchestrator.sampler import EnvironmentSampler


class ServerView:
    """What a group's episodes see of the server it was sent to: its policy version when they sample."""

    def __init__(self, server):
        self.server = server
        self.seed = None

    def seeded(self, seed):
        view = ServerView(self.server)
        view.seed = seed
        return view


class Scripted(Environment):
    """Groups that finish when `finish(index)` is called; rewards alternate 0, 1 (a signal) unless `flat`."""

    name = "scripted"
    rubric = Rubric([])

    def __init__(self, flat: bool = False):
        super().__init__()
        self.flat = flat
        self.gates: dict[int, asyncio.Event] = {}
        self.started: list[tuple[int, int, int]] = []  # (example, server, seed) per group start

    def examples(self, seed):
        for i in itertools.count():
            yield Example([{"role": "user", "content": str(i)}], str(i), {"i": i})

    def finish(self, *indices: int) -> None:
        for i in indices:
            self.gates.setdefault(i, asyncio.Event()).set()

    async def rollout_group(self, example, policy, group_size):
        i = example.info["i"]
        self.started.append((i, policy.server.index, policy.seed))
        version = policy.server.version
        await self.gates.setdefault(i, asyncio.Event()).wait()
        sample = TokenSample([1, 2, 3], [False, True, True], [0.0, -1.0, -1.0])
        rewards = [1.0] * group_size if self.flat else [float(k % 2) for k in range(group_size)]
        return [Rollout(example, [sample], [], [version] * 2, "", "stop", reward=r) for r in rewards]


def config(**overrides) -> OrchestratorConfig:
    base = {"batch_size": 4, "group_size": 2, "max_async_level": 1, "max_inflight": 64, "seed": 5}
    return OrchestratorConfig(**{**base, **overrides, "environments": {"scripted": {"name": "scripted"}}})


class Harness:
    def __init__(self, cfg: OrchestratorConfig, servers: int = 1, env: Scripted | None = None, **resumed):
        self.cfg = cfg
        self.env = env or Scripted()
        self.notifier = Notifier()
        urls = [f"http://127.0.0.1:{9 + i}" for i in range(servers)]
        self.pool = InferencePool(urls, None, 10, 10, self.notifier)
        self.queue = RolloutQueue()
        sampler = EnvironmentSampler({"scripted": self.env}, {"scripted": 1.0}, cfg.seed)
        self.dispatcher = Dispatcher(
            cfg, self.pool, {"scripted": self.env}, sampler, ServerView, self.queue, self.notifier, **resumed
        )
        self.cutter = BatchCutter(cfg.batch_size, cfg.batch_tokens, cfg.max_async_level)

    async def __aenter__(self):
        self.task = asyncio.create_task(self.dispatcher.run())
        await self.settle()
        return self

    async def __aexit__(self, *exc):
        self.task.cancel()
        for ticket in self.dispatcher.inflight.values():
            ticket.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.pool.close()

    async def settle(self) -> None:
        """Let every task run until nothing changes for a while (the dispatcher draws examples in a thread)."""
        state, quiet = None, 0
        while quiet < 3:
            self.notifier.notify()
            await asyncio.sleep(0.01)
            now = (self.sent(), len(self.dispatcher.unsent), self.dispatcher.next_index, len(self.queue))
            quiet, state = (quiet + 1 if now == state else 0), now

    def sent(self) -> list[int]:
        return sorted(self.dispatcher.inflight)

    async def cut(self, step: int):
        batch = self.cutter.cut(self.queue, step)
        assert batch is not None, f"batch {step} not ready"
        self.dispatcher.batch_cut(step)
        await self.settle()
        return batch


def run(coroutine):
    asyncio.run(asyncio.wait_for(coroutine, 10))


def test_room_under_the_bound():
    assert dispatch_room(cut=0, version=0, max_async_level=0, batch=4, committed=0) == 4
    assert dispatch_room(cut=1, version=0, max_async_level=0, batch=4, committed=0) == 0
    assert dispatch_room(cut=2, version=2, max_async_level=1, batch=4, committed=6) == 2


def test_lockstep_sends_one_batch_per_trainer_version():
    async def main():
        async with Harness(config(max_async_level=0)) as h:
            assert h.sent() == [0, 1]  # batch 1: two groups of two, and nothing more at version 0
            h.env.finish(0, 1)
            await h.settle()
            batch = await h.cut(1)
            assert [g.index for g in batch.groups] == [0, 1]
            assert h.sent() == []  # batch 2 needs version 1
            assert h.dispatcher.describe().endswith(
                "dispatch waits for policy version 1 from the trainer (is it running?)"
            )
            h.pool.servers[0].version = 1
            await h.settle()
            assert h.sent() == [2, 3]

    run(main())


def test_one_level_ahead_sends_two_batches_and_one_more_per_new_version():
    async def main():
        async with Harness(config(max_async_level=1)) as h:
            assert h.sent() == [0, 1, 2, 3]
            h.env.finish(0, 1)
            await h.settle()
            await h.cut(1)
            assert h.sent() == [2, 3]  # batch 3 needs version 1
            h.pool.servers[0].version = 1
            await h.settle()
            assert h.sent() == [2, 3, 4, 5]

    run(main())


def test_max_inflight_caps_groups_in_flight():
    async def main():
        async with Harness(config(max_async_level=3, max_inflight=3)) as h:
            assert h.sent() == [0, 1, 2]
            h.env.finish(1)
            await h.settle()
            assert h.sent() == [0, 2, 3]

    run(main())


def test_groups_that_no_later_batch_can_take_are_cancelled_when_a_batch_is_cut():
    async def main():
        async with Harness(config(max_async_level=1)) as h:
            h.env.finish(1, 2, 3)  # group 0 straggles
            await h.settle()
            await h.cut(1)  # groups 1 and 2
            h.pool.servers[0].version = 1
            await h.settle()
            h.env.finish(4)
            await h.settle()
            assert 0 in h.sent()
            await h.cut(2)  # groups 3 and 4; batch 3 needs version 1: group 0 (version 0) is useless now
            assert 0 not in h.sent()
            assert h.dispatcher.take_stats()["groups/cancelled"] == 1

    run(main())


def test_groups_go_to_the_least_loaded_server_and_back_out_when_it_goes_down():
    async def main():
        async with Harness(config(max_async_level=1), servers=2) as h:
            placed = {i: server for i, server, _ in h.env.started}
            assert sorted(placed.values()) == [0, 0, 1, 1]
            on_first = sorted(i for i, s in placed.items() if s == 0)
            seeds = {i: seed for i, _, seed in h.env.started}
            h.pool.mark_down(h.pool.servers[0], "test: connection refused")
            await h.settle()
            again = [(i, s, seed) for i, s, seed in h.env.started[4:]]
            assert sorted(i for i, _, _ in again) == on_first  # sent again, to the server that is up
            assert {s for _, s, _ in again} == {1}
            assert all(seed == seeds[i] for i, _, seed in again)  # with the same seed: the same samples
            assert h.dispatcher.take_stats()["groups/redispatched"] == 2

    run(main())


def test_groups_go_to_a_server_with_room_when_the_least_loaded_one_is_still_updating():
    """One level ahead on two servers: after batch 1, server 1 holds version 1 (room for batch 3) while server
    0, equally loaded, is still loading it (version 0: no room). Batch 3's groups go to server 1 meanwhile."""

    async def main():
        async with Harness(config(max_async_level=1), servers=2) as h:
            h.env.finish(0, 1)
            await h.settle()
            await h.cut(1)
            assert h.sent() == [2, 3]
            assert [s.samples_in_flight for s in h.pool.servers] == [2, 2]
            h.pool.servers[0].updating = True
            h.pool.servers[1].version = 1
            await h.settle()
            assert h.sent() == [2, 3, 4, 5]
            assert {i: s for i, s, _ in h.env.started if i >= 4} == {4: 1, 5: 1}

    run(main())


def test_dynamic_sampling_leaves_out_groups_without_signal_and_draws_more():
    async def main():
        async with Harness(config(max_async_level=0, dynamic_sampling=True), env=Scripted(flat=True)) as h:
            h.env.finish(0, 1)
            await h.settle()
            assert h.sent() == [2, 3]  # the flat groups made room for two more
            assert len(h.queue) == 0
            assert h.dispatcher.take_stats()["batch/filtered_groups"] == 2

    run(main())


def test_without_dynamic_sampling_groups_without_signal_still_fill_the_batch():
    async def main():
        async with Harness(config(max_async_level=0), env=Scripted(flat=True)) as h:
            h.env.finish(0, 1)
            await h.settle()
            batch = await h.cut(1)
            assert batch.samples(1.0) == []

    run(main())


def test_seeds_follow_the_group_number_whatever_the_concurrency():
    async def seeds(inflight: int) -> list[int]:
        async with Harness(config(max_async_level=0, max_inflight=inflight)) as h:
            for i in range(2):
                h.env.finish(i)
                await h.settle()
            return [seed for _, _, seed in sorted(h.env.started)]

    one_at_a_time, all_at_once = asyncio.run(seeds(1)), asyncio.run(seeds(64))
    assert len(set(one_at_a_time)) == 2 and one_at_a_time == all_at_once


def test_a_resumed_run_sends_groups_only_to_servers_as_new_as_at_its_checkpoint():
    """Resumed after batch 2, whose servers held version 2, with a loose bound: the new servers start on the
    base model (version 0), which the bound alone would allow; no group goes out until they hold version 2."""

    async def main():
        async with Harness(config(max_async_level=8), cut=2, next_index=4, version_floor=2) as h:
            assert h.sent() == []
            assert h.dispatcher.describe().endswith(
                "dispatch waits for policy version 2 from the trainer (is it running?)"
            )
            h.pool.servers[0].version = 2
            await h.settle()
            assert h.sent()[:2] == [4, 5] and all(t.version == 2 for t in h.dispatcher.inflight.values())

    run(main())
