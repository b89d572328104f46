"""The orchestrator's side of an env-server: `RemoteEnvironment` is an `Environment` whose examples, `respond()`
and scoring happen on one or several env-servers, while its episodes (`rollout_group`, `play`) and their
generation stay in the orchestrator, with the policy it is given.

`environment_from_config` builds the environment of an `[orchestrator.environments.<label>]` section: in this
process, or a `RemoteEnvironment`. `environment_server` starts the 'local' env-server: an `asyncrl env-server`
child of this process, on a free loopback port, that exits with it.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import httpx

from asyncrl.config.schema import RLEnvironmentConfig
from asyncrl.env_server.workers import example_from_json, example_to_json
from asyncrl.environments import load_environment
from asyncrl.environments.base import Environment, Example, Messages, RolloutLimits, State
from asyncrl.environments.rubric import Score
from asyncrl.errors import AsyncRLError

EXAMPLES_PER_REQUEST = 64
REQUEST_TIMEOUT = 600.0  # seconds for one HTTP call; a worker's own limit (call_timeout) is what usually applies
START_TIMEOUT = 60.0  # seconds for a local env-server to answer /health

_local_url: str | None = None


class EnvironmentWorkerError(Exception):
    """What `respond` raised in its worker, or that the worker crashed or hung: the rollout is errored."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_env_server() -> str:
    """The URL of this process's local env-server, started on first use."""
    global _local_url
    if _local_url is not None:
        return _local_url
    port = _free_port()
    argv = [sys.executable, "-m", "asyncrl", "env-server", "--port", str(port), "--parent-pid", str(os.getpid())]
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    atexit.register(_stop, process)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if process.poll() is not None:
            raise AsyncRLError(f"the local env-server exited with code {process.returncode} at start")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise AsyncRLError(f"the local env-server did not answer on {url} within {START_TIMEOUT:.0f}s")
        time.sleep(0.1)
    _local_url = url
    return url


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def in_background(call: Callable[..., Any], *args: Any) -> Future:
    """`call(*args)` in a daemon thread (one a stream drops, or a hung server, never holds up the exit)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(call(*args))
        except BaseException as error:  # noqa: BLE001 - the caller's result() raises it
            future.set_exception(error)

    threading.Thread(target=run, name="env-server-examples", daemon=True).start()
    return future


class EnvServerClient:
    """One env-server as one registered environment sees it."""

    def __init__(self, url: str, label: str):
        self.url = url.rstrip("/")
        self.label = label
        self.http = httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT)
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )
        self.in_flight = 0

    def _failed(self, route: str, error: Exception | httpx.Response) -> AsyncRLError:
        if isinstance(error, httpx.Response):
            is_json = "json" in error.headers.get("content-type", "")
            detail = error.json().get("detail", error.text) if is_json else error.text
            return AsyncRLError(f"env-server {self.url}{route} refused environment '{self.label}': {detail}")
        return AsyncRLError(f"env-server at {self.url} is not reachable for {route} ({error}); did it stop?")

    def post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self.http.post(route, json=body)
        except httpx.TransportError as e:
            raise self._failed(route, e) from None
        if response.status_code != 200:
            raise self._failed(route, response)
        return response.json()

    async def apost(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        if loop not in self._async:  # an httpx.AsyncClient belongs to the event loop it first ran in
            self._async[loop] = httpx.AsyncClient(base_url=self.url, timeout=REQUEST_TIMEOUT)
        self.in_flight += 1
        try:
            response = await self._async[loop].post(route, json=body)
        except httpx.TransportError as e:
            raise self._failed(route, e) from None
        finally:
            self.in_flight -= 1
        if response.status_code != 200:
            raise self._failed(route, response)
        return response.json()


class RemoteEnvironment(Environment):
    """An environment served by env-servers: the same name, tools and limits, its examples, `respond` and
    rubric run there. `state` and `Example.info` travel as JSON with each call."""

    def __init__(self, label: str, name: str, args: dict[str, Any], urls: list[str], workers: int, call_timeout: float):
        self.name = name
        self.servers = [EnvServerClient(local_env_server() if url == "local" else url, label) for url in urls]
        registration = {"label": label, "name": name, "args": args, "workers": workers, "call_timeout": call_timeout}
        described = [server.post("/environments", registration) for server in self.servers]
        self.ids = [d["id"] for d in described]
        self.tools = described[0]["tools"]
        self.limits = RolloutLimits(**described[0]["limits"])

    def _stream(self, seed: int | None) -> Iterator[Example]:
        """The examples, fetched a batch at a time from the first server. The next batch is asked for as soon as
        the last one arrives, in a thread: the orchestrator draws examples inside its event loop, which then waits
        on the network only when it draws faster than the server makes examples."""

        def fetch(start: int) -> list[dict[str, Any]]:
            body = {"id": self.ids[0], "seed": seed, "start": start, "count": EXAMPLES_PER_REQUEST}
            return self.servers[0].post("/examples", body)["examples"]

        def stream(pending: Future) -> Iterator[Example]:
            start = 0
            while True:
                batch = pending.result()
                start += len(batch)
                if len(batch) == EXAMPLES_PER_REQUEST:
                    pending = in_background(fetch, start)
                yield from (example_from_json(e) for e in batch)
                if len(batch) < EXAMPLES_PER_REQUEST:
                    return

        return stream(in_background(fetch, 0))  # the first batch is on its way before the first draw

    def examples(self, seed: int) -> Iterator[Example]:
        return self._stream(seed)

    def eval_examples(self) -> Iterator[Example]:
        return self._stream(None)

    async def _call(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """On the least busy of the servers."""
        index = min(range(len(self.servers)), key=lambda i: self.servers[i].in_flight)
        return await self.servers[index].apost(route, {"id": self.ids[index], **body})

    async def respond(self, messages: Messages, state: State, example: Example, turn: int) -> Messages | None:
        body = {"messages": messages, "state": state, "example": example_to_json(example), "turn": turn}
        result = await self._call("/respond", body)
        if "error" in result:
            raise EnvironmentWorkerError(result["error"])
        state.clear()
        state.update(result["state"])  # the loop holds this dict: the episode's state is what the worker kept
        return result["reply"]

    async def score(
        self, completion: str, example: Example, state: State, messages: Messages, turns: int, is_truncated: bool
    ) -> Score:
        body = {"completion": completion, "example": example_to_json(example), "state": state,
                "messages": messages, "turns": turns, "is_truncated": is_truncated}  # fmt: skip
        result = await self._call("/score", body)
        if "worker_failed" in result or set(result) == {"error"}:
            return Score(reward=0.0, error=result["error"])
        return Score(**result)


def environment_from_config(label: str, cfg: RLEnvironmentConfig) -> Environment:
    """The environment of `[orchestrator.environments.<label>]`: in this process, or served by env-servers
    (`env_server`): then its respond() and rewards run in their worker processes (docs/environments.md)."""
    name = cfg.name or label
    if cfg.env_server is None:
        return load_environment(name, **cfg.args)
    urls = [cfg.env_server] if isinstance(cfg.env_server, str) else list(cfg.env_server)
    return RemoteEnvironment(label, name, cfg.args, urls, cfg.workers, cfg.call_timeout)
