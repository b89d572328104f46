"""Worker processes of one environment: each runs `respond()` and the rubric, one call at a time.

A call goes to an idle worker over a pipe. A worker that dies during a call (a crash, `os._exit`, the
kernel's OOM killer) or that does not answer within `call_timeout` (an endless loop, a blocking sleep) is
killed and replaced by a fresh one, and the call fails with `WorkerFailed`: the rollout it belonged to is
errored and counted, and the other workers go on. Workers are started with `spawn`, so they inherit no
sockets or threads from the server; they exit when the server's end of their pipe closes, and die with the
server however it ends, even in the middle of a call.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import multiprocessing
import os
import time
from dataclasses import asdict
from typing import Any

from asyncrl.environments.base import Example

log = logging.getLogger("asyncrl.env_server")
START_TIMEOUT = 120.0  # seconds for a new worker to import and build its environment


class WorkerFailed(Exception):
    """The call's worker crashed or hung; it has been replaced."""


def example_from_json(data: dict[str, Any]) -> Example:
    return Example(prompt=data["prompt"], answer=data["answer"], info=data.get("info") or {})


def example_to_json(example: Example) -> dict[str, Any]:
    return {"prompt": example.prompt, "answer": example.answer, "info": example.info}


async def _handle(env: Any, method: str, payload: dict[str, Any]) -> dict[str, Any]:
    example = example_from_json(payload["example"])
    state = payload["state"]
    if method == "respond":
        turn = {"turn": payload["turn"]} if "turn" in inspect.signature(env.respond).parameters else {}
        reply = await env.respond(payload["messages"], state, example, **turn)
        return {"reply": reply, "state": state}
    score = await env.rubric.score(
        payload["completion"], example, state, payload["messages"], payload["turns"], payload["is_truncated"]
    )
    return asdict(score)


def worker_main(connection: Any, name: str, args: dict[str, Any], server_pid: int) -> None:
    """A worker's life: build the environment, then answer calls until the pipe closes."""
    from asyncrl.environments import load_environment
    from asyncrl.processes import die_with_parent

    die_with_parent(server_pid)

    try:
        env = load_environment(name, **args)
    except Exception as e:  # noqa: BLE001 - reported to the server, which names it
        connection.send(("error", f"{type(e).__name__}: {e}"))
        return
    connection.send(("ready", None))
    loop = asyncio.new_event_loop()
    while True:
        try:
            method, payload = connection.recv()
        except (EOFError, OSError):  # the server is gone
            return
        try:
            connection.send(("ok", loop.run_until_complete(_handle(env, method, payload))))
        except Exception as e:  # noqa: BLE001 - the environment's failure marks the rollout, never the worker
            connection.send(("error", f"{type(e).__name__}: {e}"))


class Worker:
    def __init__(self, name: str, args: dict[str, Any]):
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=worker_main, args=(child, name, args, os.getpid()), daemon=True)
        self.process.start()
        child.close()

    async def receive(self, timeout: float | None) -> tuple[str, Any]:
        """The worker's next message, read when the pipe becomes readable (no thread waits on it)."""
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = self.connection.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.wait_for(readable, timeout)
        finally:
            loop.remove_reader(fd)
        return self.connection.recv()  # EOFError when the worker died

    async def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        await asyncio.to_thread(self.process.join, 10)
        self.connection.close()


class WorkerPool:
    """`size` workers of one environment; `call` runs a method on an idle one."""

    def __init__(self, label: str, name: str, args: dict[str, Any], size: int, call_timeout: float):
        self.label, self.name, self.args = label, name, args
        self.size = size
        self.call_timeout = call_timeout
        self.idle: asyncio.Queue[Worker] = asyncio.Queue()
        self.restarts = 0
        self.failed_calls = 0
        self.workers: list[Worker] = []

    async def start(self) -> None:
        for worker in await asyncio.gather(*(self._new_worker() for _ in range(self.size))):
            self.idle.put_nowait(worker)

    async def _new_worker(self) -> Worker:
        worker = Worker(self.name, self.args)
        self.workers.append(worker)
        try:
            kind, detail = await worker.receive(START_TIMEOUT)
        except (TimeoutError, EOFError):
            kind, detail = "error", f"the worker did not start within {START_TIMEOUT:.0f}s"
        if kind != "ready":
            await self._discard(worker)
            raise RuntimeError(f"environment '{self.label}' failed in a worker process: {detail}")
        return worker

    async def _discard(self, worker: Worker) -> None:
        self.workers.remove(worker)
        await worker.stop()

    async def call(self, method: str, payload: dict[str, Any]) -> dict[str, Any]:
        """The method's result; `RuntimeError` with the environment's own error; `WorkerFailed` when the
        worker crashed or hung (it is replaced before this returns)."""
        worker = await self.idle.get()
        start = time.monotonic()
        try:
            worker.connection.send((method, payload))
            kind, result = await worker.receive(self.call_timeout)
        except asyncio.CancelledError:  # the caller gave up: the worker is still busy, so it is replaced
            asyncio.get_running_loop().create_task(self._replace(worker))
            raise
        except (TimeoutError, EOFError, OSError) as e:
            hung = isinstance(e, TimeoutError)
            if not hung:  # the pipe closed as the worker died: wait for its exit code
                await asyncio.to_thread(worker.process.join, 5)
            code = worker.process.exitcode
            self.failed_calls += 1
            what = f"did not answer within {self.call_timeout:.0f}s" if hung else f"crashed (exit code {code})"
            log.warning("environment '%s': a worker %s during %s; restarting it", self.label, what, method)
            await self._replace(worker)
            raise WorkerFailed(f"env-server worker of '{self.label}' {what} during {method}; restarted") from None
        self.idle.put_nowait(worker)
        if kind == "error":
            raise RuntimeError(result)
        log.debug("%s %s in %.3fs", self.label, method, time.monotonic() - start)
        return result

    async def _replace(self, worker: Worker) -> None:
        await self._discard(worker)
        self.restarts += 1
        self.idle.put_nowait(await self._new_worker())

    async def stop(self) -> None:
        await asyncio.gather(*(worker.stop() for worker in list(self.workers)))
        self.workers.clear()
