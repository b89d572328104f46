"""The orchestrator's failure policy, over real sockets: the real client, pool and dispatcher talk to small
HTTP servers on loopback that answer like an inference server's /health and /v1/generate, but fail on a
schedule (a 500, a 400 for a prompt too long, an answer slower than request_timeout, or nothing listening).
A request the server rejects fails its group and the run goes on; one the server failed goes again to
another server; a server is marked down only after failures in a row; the run stops, with one line, when
too many groups fail or no server is left."""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from asyncrl.config import OrchestratorConfig
from asyncrl.environments.base import Environment, Example
from asyncrl.environments.rubric import Rubric
from asyncrl.errors import AsyncRLError
from asyncrl.models.offline import build_tokenizer
from asyncrl.orchestrator.batch import BatchCutter
from asyncrl.orchestrator.client import InferenceClient, RequestRejected, ServedPolicy
from asyncrl.orchestrator.dispatcher import Dispatcher
from asyncrl.orchestrator.loop import next_batch
from asyncrl.orchestrator.notify import Notifier
from asyncrl.orchestrator.pool import InferencePool
from asyncrl.orchestrator.queue import RolloutQueue
from asyncrl.orchestrator.sampler import EnvironmentSampler

TOKENIZER = build_tokenizer()
LONG = 200  # prompts of more tokens than this are "too long" for the servers that check
END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")


@dataclass
class Reply:
    status: int = 200
    delay: float = 0.0  # seconds before the answer


class FaultyServer:
    """An HTTP server on a free loopback port with /health and /v1/generate; `rule(n, body)` says how the
    n-th generate request (from 1) is answered. Choice i of an answer is the text `answers[i % len]`."""

    def __init__(self, rule: Callable[[int, dict], Reply] = lambda n, body: Reply(), answers: tuple = ("ok",)):
        self.rule, self.answers = rule, answers
        self.requests: list[dict] = []
        # Bound here and handed to uvicorn, so that no other process can take the port in between.
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict:
            return {"ready": True, "policy_version": 0}

        @app.post("/v1/generate")
        async def generate(body: dict):
            self.requests.append(body)
            reply = self.rule(len(self.requests), body)
            await asyncio.sleep(reply.delay)
            if reply.status != 200:
                return JSONResponse({"detail": f"injected {reply.status}"}, status_code=reply.status)
            choices = []
            for i in range(body["n"]):
                ids = TOKENIZER.encode(self.answers[i % len(self.answers)]) + [END]
                choices.append({"token_ids": ids, "logprobs": [-0.5] * len(ids), "policy_versions": [0] * len(ids),
                                "finish_reason": "stop"})  # fmt: skip
            return {"choices": choices}

        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> FaultyServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the test server did not start in 10 s"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.socket.close()


def too_long(status: int = 400) -> Callable[[int, dict], Reply]:
    return lambda n, body: Reply(status if len(body["prompt_ids"]) > LONG else 200)


class Tasks(Environment):
    """Single-turn tasks; those numbered in `long` have a prompt too long for `too_long` servers."""

    name = "tasks"
    rubric = Rubric([])

    def __init__(self, long: tuple[int, ...] = ()):
        super().__init__()
        self.long = long

    def examples(self, seed):
        for i in itertools.count():
            content = "x" * 2 * LONG if i in self.long else f"task {i}"
            yield Example([{"role": "user", "content": content}], "", {"i": i})


def config(**overrides) -> OrchestratorConfig:
    base = {"batch_size": 4, "group_size": 2, "max_async_level": 0, "seed": 3, "seq_len": 512}
    return OrchestratorConfig(**{**base, **overrides, "environments": {"tasks": {"name": "tasks"}}})


class Run:
    """The real dispatcher, pool, client and batch wait over `servers`."""

    def __init__(self, cfg: OrchestratorConfig, servers: list[FaultyServer], env: Environment | None = None):
        self.cfg, self.env = cfg, env or Tasks()
        self.notifier = Notifier()
        self.pool = InferencePool(
            [s.url for s in servers], None, cfg.request_timeout, cfg.server_timeout, self.notifier, None,
            cfg.server_failures_before_down, cfg.no_server_timeout,
        )  # fmt: skip
        policies = {s.index: ServedPolicy(s.client, TOKENIZER, cfg.sampling, cfg.seq_len) for s in self.pool.servers}
        sampler = EnvironmentSampler({"tasks": self.env}, {"tasks": 1.0}, cfg.seed)
        self.dispatcher = Dispatcher(
            cfg, self.pool, {"tasks": self.env}, sampler, lambda s: policies[s.index], RolloutQueue(), self.notifier
        )
        self.cutter = BatchCutter(cfg.batch_size, cfg.batch_tokens, cfg.max_async_level)

    async def batches(self, steps: int, timeout: float = 10) -> list:
        """Run the dispatcher until `steps` batches are cut; the metrics of each step, with the batch."""
        task = asyncio.create_task(self.dispatcher.run(), name="dispatcher")
        cut = []
        try:
            for step in range(1, steps + 1):
                batch = await next_batch(step, self.cutter, self.dispatcher, [task], timeout)
                self.dispatcher.batch_cut(step)
                for server in self.pool.servers:
                    server.version = step  # the trainer's weights are live: the next batch may go out
                cut.append((batch, {**self.dispatcher.take_stats(), **self.pool.take_stats()}))
        finally:
            task.cancel()
            for ticket in self.dispatcher.inflight.values():
                ticket.task.cancel()
            await asyncio.gather(task, *(t.task for t in self.dispatcher.inflight.values()), return_exceptions=True)
            await self.pool.close()
        return cut


def run(coroutine, timeout: float = 20):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def test_a_500_sends_the_group_to_the_other_server_and_no_group_is_lost():
    with FaultyServer(lambda n, body: Reply(500 if n == 1 else 200)) as flaky, FaultyServer() as healthy:
        [(batch, stats)] = run(Run(config(), [flaky, healthy]).batches(1))
    assert sorted(g.index for g in batch.groups) == [0, 1]
    assert {g.server for g in batch.groups} == {healthy.url}  # group 0 went again, to the healthy server
    assert stats["groups/retried"] == 1 and stats["groups/failed"] == 0
    assert stats["failed_requests/server_error"] == 1
    assert stats["server/0/up"] == 1  # one failure is not a dead server


def test_a_refused_connection_sends_the_group_to_the_other_server():
    with FaultyServer() as gone, FaultyServer() as healthy:
        gone.__exit__()  # nothing listens on its port any more
        [(batch, stats)] = run(Run(config(), [gone, healthy]).batches(1))
    assert {g.server for g in batch.groups} == {healthy.url}
    assert stats["failed_requests/connection"] == 1 and stats["groups/retried"] == 1


def test_a_server_is_marked_down_after_failures_in_a_row():
    with FaultyServer(lambda n, body: Reply(500)) as broken, FaultyServer() as healthy:
        # max_async_level 1: two batches' worth of groups go out at once, half of them to the broken server
        r = Run(config(batch_size=8, max_async_level=1, server_failures_before_down=3), [broken, healthy])
        [(batch, stats)] = run(r.batches(1))
    assert 3 <= len(broken.requests) <= 4  # the 4th may have been sent before the 3rd failed
    assert stats["server/0/up"] == 0 and stats["pool/times_down"] == 1
    assert "3 requests in a row failed" in r.pool.servers[0].down_reason
    assert {g.server for g in batch.groups} == {healthy.url}


def test_a_rejected_request_fails_its_group_and_the_run_goes_on(capsys):
    with FaultyServer(too_long()) as server:
        [(batch, stats)] = run(Run(config(), [server], Tasks(long=(1,))).batches(1))
    assert [g.index for g in batch.groups] == [0, 2]  # group 1 failed; another example took its place
    assert stats["groups/failed"] == 1 and stats["groups/retried"] == 0
    assert stats["failed_requests/client_error"] == 1
    assert stats["server/0/up"] == 1
    assert capsys.readouterr().out.count("group 1 (tasks, prompt 'xxxx") == 1  # reported once, by its prompt


def test_more_failed_groups_than_max_failed_fraction_stop_the_run_with_one_message():
    with FaultyServer(too_long()) as server:
        r = Run(config(max_failed_fraction=0.5), [server], Tasks(long=(0, 1, 2, 3)))
        with pytest.raises(AsyncRLError) as stopped:
            run(r.batches(1))
    message = str(stopped.value)
    assert "2 of the 2 groups that ended since batch 0 was cut failed" in message
    assert "orchestrator.max_failed_fraction = 0.5" in message and "(400)" in message


def test_a_slow_answer_is_retried_on_the_same_server_after_a_backoff_and_the_server_stays_up():
    with FaultyServer(lambda n, body: Reply(delay=1.0 if n == 1 else 0.0)) as slow:
        r = Run(config(request_timeout=0.3), [slow])
        start = time.monotonic()
        [(batch, stats)] = run(r.batches(1))
    assert len(batch.groups) == 2
    assert stats["failed_requests/timeout"] == 1 and stats["groups/retried"] == 1
    assert stats["server/0/up"] == 1 and r.pool.servers[0].failures_in_a_row == 0
    assert time.monotonic() - start > 0.3 + 0.5  # the timeout, then the first backoff


class Cancellable(Tasks):
    """Two episodes per group: the one that answered "short" asks a follow-up so long that the server rejects
    it; the other's `respond` waits, and records whether it was cancelled."""

    def __init__(self):
        super().__init__()
        self.cancelled = asyncio.Event()

    async def respond(self, messages, state, example):
        if messages[-1]["content"] == "short":
            return [{"role": "user", "content": "y" * 2 * LONG}]
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def test_a_failed_episode_cancels_its_siblings_and_the_error_is_the_groups():
    async def main():
        env = Cancellable()
        client = InferenceClient(server.url, None, request_timeout=5)
        policy = ServedPolicy(client, TOKENIZER, config().sampling, seq_len=2048)
        [example] = [e for _, e in zip(range(1), env.examples(0))]
        start = time.monotonic()
        try:
            with pytest.raises(RequestRejected, match=r"\(400\)"):
                await env.rollout_group(example, policy, 2)
        finally:
            await client.close()
        assert env.cancelled.is_set()
        assert time.monotonic() - start < 5  # not the sibling's 30 s

    with FaultyServer(too_long(), answers=("short", "long")) as server:
        run(main())


def test_when_the_last_server_dies_the_run_stops_after_no_server_timeout_naming_it(capsys):
    async def main():
        pool = InferencePool([server.url], None, 5, 0.5, Notifier(), no_server_timeout=0.5)
        watch = asyncio.create_task(pool.watch_health())
        try:
            server.__exit__()  # it dies: /health is refused
            deadline = time.monotonic() + 10
            while pool.error is None:
                assert time.monotonic() < deadline, "the pool did not give up in 10 s"
                pool.check_servers()
                await asyncio.sleep(0.05)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            await pool.close()
        return pool.error

    with FaultyServer() as server:
        error = run(main())
    assert str(error).startswith("no inference server has been up for 0.5s (orchestrator.no_server_timeout)")
    assert server.url in str(error)
    out = capsys.readouterr().out
    assert f"inference server {server.url} is down" in out and "no inference server is left" in out
