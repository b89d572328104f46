"""The inference servers of a run, as the orchestrator sees them: who is up, which weights each serves, how
much work each has, and which one takes the next group.

- **Routing.** A group goes to the server with the fewest samples in flight (ties: the first) among those
  not updating their weights, else among those that are; the dispatcher takes the first of that order whose
  weights leave room under the off-policy bound. All of a group's requests stay there, so its prompt is
  prefilled once.
- **Weights.** `follow_weights` watches the trainer's published versions (`newest_published`: the next
  version's marker every WEIGHTS_POLL seconds) and brings every server up to the newest: pause, load,
  resume, between two decoding steps, while requests stay in flight. Each server's version is tracked on
  its own; a server serves groups only while its weights are new enough for the next batch.
- **Health.** `watch_health` asks each server's /health every few seconds. A server is marked down when
  it leaves /health unanswered for `server_timeout`, or when `server_failures_before_down` requests in a
  row failed by its fault (`request_failed`; a timed-out request is not its fault: health decides); its
  groups go to the others (the dispatcher does that). A down server that answers again is brought up to
  the newest weights and used again. When none has been up for `no_server_timeout`, `error` stops the run.
- **Bookkeeping** for metrics: samples in flight, completion tokens, and how long each server had nothing to
  do, per batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config.schema import SamplingConfig
from asyncrl.environments.base import Completion
from asyncrl.errors import AsyncRLError
from asyncrl.orchestrator.client import (
    CLIENT_ERROR,
    CONNECTION,
    SERVER_ERROR,
    TIMEOUT,
    InferenceClient,
    RequestFailed,
    ServerUnavailable,
)
from asyncrl.orchestrator.notify import Notifier
from asyncrl.transport import weights

log = logging.getLogger("asyncrl.orchestrator")

HEALTH_INTERVAL = 2.0  # seconds between two /health checks of one server
FAILURE_REASONS = (CLIENT_ERROR, SERVER_ERROR, CONNECTION, TIMEOUT)
WEIGHTS_POLL = 0.05  # seconds between two looks for the next version's STABLE marker
WEIGHTS_SCAN = 2.0  # seconds between two listings of the whole weights folder


@dataclass(eq=False)
class Server:
    index: int
    url: str
    client: InferenceClient
    up: bool = True
    version: int = 0  # the policy version it serves
    down_reason: str = ""
    updating: bool = False
    samples_in_flight: int = 0  # of training groups and evals
    groups_in_flight: int = 0  # training groups
    times_down: int = 0
    failures_in_a_row: int = 0  # requests failed by the server's fault since its last success
    # Per batch (reset by `Pool.take_stats`):
    completion_tokens: int = 0
    idle_seconds: float = 0.0
    idle_since: float | None = field(default_factory=time.monotonic)


class InferencePool:
    def __init__(
        self,
        urls: list[str],
        admin_token: str | None,
        request_timeout: float,
        server_timeout: float,
        notifier: Notifier,
        api_key: str | None = None,
        failures_before_down: int = 3,
        no_server_timeout: float = 300.0,
    ):
        self.servers = [
            Server(i, url.rstrip("/"), InferenceClient(url, admin_token, request_timeout, api_key))
            for i, url in enumerate(urls)
        ]
        self.server_timeout = server_timeout
        self.failures_before_down = failures_before_down
        self.no_server_timeout = no_server_timeout
        self.notifier = notifier
        self.target_version = 0  # the newest published version: every server is brought up to it
        self.error: Exception | None = None  # a failure that must stop the run (a weight update refused)
        self._updates: set[asyncio.Task] = set()
        self._stats_since = time.monotonic()
        self._none_up_since: float | None = None
        self._failed_requests = dict.fromkeys(FAILURE_REASONS, 0)

    async def close(self) -> None:
        for task in list(self._updates):
            task.cancel()
        await asyncio.gather(*self._updates, return_exceptions=True)
        await asyncio.gather(*(server.client.close() for server in self.servers))

    async def wait_ready(self, timeout: float) -> None:
        """Wait until every server answers /health as ready; their versions are read then."""

        async def ready(server: Server) -> None:
            state = await server.client.wait_ready(timeout)
            server.version = int(state.get("policy_version", 0))

        await asyncio.gather(*(ready(server) for server in self.servers))

    # ---- routing ----

    def serving(self, oldest_useful: int) -> list[Server]:
        """The servers that may take new groups: up, with weights at least `oldest_useful`."""
        return [s for s in self.servers if s.up and s.version >= oldest_useful]

    def by_preference(self, oldest_useful: int, avoid: Server | None = None) -> list[Server]:
        """The serving servers (less `avoid`) in the order a new group should try them: those not updating their
        weights first (one that is pauses between two steps to load them), each side least loaded first."""
        candidates = [s for s in self.serving(oldest_useful) if s is not avoid]
        return sorted(candidates, key=lambda s: (s.updating, s.samples_in_flight, s.index))

    def least_loaded(self, oldest_useful: int, avoid: Server | None = None) -> Server | None:
        return next(iter(self.by_preference(oldest_useful, avoid)), None)

    def started(self, server: Server, samples: int, group: bool) -> None:
        if server.samples_in_flight == 0 and server.idle_since is not None:
            server.idle_seconds += time.monotonic() - server.idle_since
            server.idle_since = None
        server.samples_in_flight += samples
        server.groups_in_flight += group

    def finished(self, server: Server, samples: int, group: bool, completion_tokens: int = 0) -> None:
        server.samples_in_flight -= samples
        server.groups_in_flight -= group
        server.completion_tokens += completion_tokens
        if server.samples_in_flight == 0:
            server.idle_since = time.monotonic()
        self.notifier.notify()

    # ---- health ----

    def request_failed(self, server: Server, error: RequestFailed) -> None:
        """Count a failed request of `server`; one by the server's fault (not a timeout) that is the
        `failures_before_down`-th in a row marks it down."""
        self._failed_requests[error.reason] += 1
        if error.reason in (SERVER_ERROR, CONNECTION):
            server.failures_in_a_row += 1
            if server.failures_in_a_row >= self.failures_before_down:
                self.mark_down(server, f"{server.failures_in_a_row} requests in a row failed, the last: {error}")

    def request_succeeded(self, server: Server) -> None:
        server.failures_in_a_row = 0

    def mark_down(self, server: Server, reason: str) -> None:
        if not server.up:
            return
        server.up, server.down_reason = False, reason
        server.times_down += 1
        up = sum(s.up for s in self.servers)
        log.warning("inference server %s marked down (%s); %d of %d up", server.url, reason, up, len(self.servers))
        if up:
            print(f"orchestrator: inference server {server.url} is down ({reason}); {up} still up", flush=True)
        else:
            self._none_up_since = time.monotonic()
            print(
                f"orchestrator: inference server {server.url} is down ({reason}); no inference server is left "
                f"(the run stops unless one answers within {self.no_server_timeout:g}s)",
                flush=True,
            )
        self.notifier.notify()

    def check_servers(self) -> None:
        """Set `error` once no server has been up for `no_server_timeout` seconds."""
        if self._none_up_since is None or self.error is not None:
            return
        if time.monotonic() - self._none_up_since > self.no_server_timeout:
            self.error = AsyncRLError(
                f"no inference server has been up for {self.no_server_timeout:g}s "
                f"(orchestrator.no_server_timeout): {self.down_servers()}"
            )

    def mark_up(self, server: Server, version: int) -> None:
        server.up, server.down_reason, server.version = True, "", version
        server.failures_in_a_row = 0
        self._none_up_since = None
        log.warning("inference server %s is back (policy version %d)", server.url, version)
        print(f"orchestrator: inference server {server.url} is back", flush=True)
        self.notifier.notify()

    async def watch_health(self) -> None:
        """Forever: check every server's /health, mark it down or back up."""

        async def watch(server: Server) -> None:
            while True:
                try:
                    state = await server.client.health(self.server_timeout)
                except ServerUnavailable as error:
                    self.mark_down(server, str(error))
                else:
                    reported = int(state.get("policy_version", 0))
                    if not server.up:
                        self.mark_up(server, reported)
                    elif reported < server.version:  # it restarted: its weights are the base model's again
                        server.version = reported
                        self.notifier.notify()
                await asyncio.sleep(HEALTH_INTERVAL)

        await asyncio.gather(*(watch(server) for server in self.servers))

    def down_servers(self) -> str:
        return "; ".join(f"{s.url}: {s.down_reason}" for s in self.servers if not s.up)

    # ---- weights ----

    async def follow_weights(self, output_dir: Path, source: Callable[[int], Path | None]) -> None:
        """Forever: bring every server up to the newest published version. `source(version)` is what a
        server loads it from: the published folder, or None for the weight broadcast."""
        last_scan = -WEIGHTS_SCAN
        while True:
            scan = time.monotonic() - last_scan >= WEIGHTS_SCAN
            last_scan = time.monotonic() if scan else last_scan
            self.target_version = await asyncio.to_thread(newest_published, output_dir, self.target_version, scan)
            for server in self.servers:
                if server.up and not server.updating and server.version < self.target_version:
                    server.updating = True
                    task = asyncio.create_task(self._update(server, self.target_version, source))
                    self._updates.add(task)
                    task.add_done_callback(self._updates.discard)
            if self.error is not None:
                return
            await asyncio.sleep(WEIGHTS_POLL)

    async def _update(self, server: Server, version: int, source: Callable[[int], Path | None]) -> None:
        start = time.monotonic()
        try:
            server.version = await server.client.update_weights(source(version), version)
            log.info("%s serves policy version %d (%.2fs)", server.url, server.version, time.monotonic() - start)
        except ServerUnavailable as error:
            if error.reason == SERVER_ERROR:  # the server is there and could not load them: loading fails again
                self.error = AsyncRLError(f"weight update of {server.url} to version {version} failed: {error}")
            else:
                self.mark_down(server, str(error))
        except AsyncRLError as error:
            self.error = AsyncRLError(f"weight update of {server.url} to version {version} failed: {error}")
        finally:
            server.updating = False
            self.notifier.notify()

    # ---- metrics ----

    def take_stats(self) -> dict[str, Any]:
        """Per-server and pool metrics since the last call (one batch)."""
        now = time.monotonic()
        elapsed = max(now - self._stats_since, 1e-9)
        self._stats_since = now
        metrics: dict[str, Any] = {}
        idle_fractions = []
        for s in self.servers:
            idle = s.idle_seconds + (now - s.idle_since if s.idle_since is not None else 0.0)
            idle_fractions.append(min(idle / elapsed, 1.0))
            metrics[f"server/{s.index}/up"] = int(s.up)
            metrics[f"server/{s.index}/policy_version"] = s.version
            metrics[f"server/{s.index}/groups_in_flight"] = s.groups_in_flight
            metrics[f"perf/server/{s.index}/tokens_per_s"] = s.completion_tokens / elapsed
            metrics[f"perf/server/{s.index}/idle"] = idle_fractions[-1]
            s.completion_tokens, s.idle_seconds = 0, 0.0
            s.idle_since = now if s.idle_since is not None else None
        for reason, count in self._failed_requests.items():
            metrics[f"failed_requests/{reason}"] = count
        self._failed_requests = dict.fromkeys(FAILURE_REASONS, 0)
        metrics["pool/servers_up"] = sum(s.up for s in self.servers)
        metrics["pool/times_down"] = sum(s.times_down for s in self.servers)
        metrics["perf/inference_idle"] = sum(idle_fractions) / len(idle_fractions)
        metrics["pool/oldest_version"] = min((s.version for s in self.servers if s.up), default=0)
        return metrics


def newest_published(output_dir: Path, known: int, scan: bool) -> int:
    """The newest published version, `known` or later. Every WEIGHTS_POLL seconds only the markers of the
    versions after `known` are looked up, one stat each: a listing of the weights folder (every version kept,
    on a shared filesystem) that often would cost the filesystem more than the run gains. With `scan` (every
    WEIGHTS_SCAN seconds, and first) the folder is listed too, for a version that does not follow the one
    known: the first look of a resumed run, or versions published and pruned between two looks. The
    orchestrator calls this in a thread: a shared filesystem may take its time to answer even a stat."""
    version = max(known, weights.latest_version(output_dir)) if scan else known
    while (weights.weights_dir(output_dir, version + 1) / weights.MARKER).exists():
        version += 1
    return version


class PooledPolicy:
    """A `Policy` over the whole pool, for work outside training groups (online evals): each request goes to
    the least-loaded server that is up, and to the least-loaded again (at most `ATTEMPTS` times) when it
    failed by the server's fault; a request the server rejected (HTTP 4xx) fails at once."""

    ATTEMPTS = 3

    def __init__(self, pool: InferencePool, tokenizer: Any, sampling: SamplingConfig, seq_len: int | None = None):
        self.pool = pool
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.temperature = sampling.temperature
        self.max_tokens = sampling.max_tokens
        self.seq_len = seq_len

    async def generate(
        self, prompt_ids: list[int], n: int, max_tokens: int | None = None, seed: int | None = None
    ) -> list[Completion]:
        for attempt in range(self.ATTEMPTS):
            server = self.pool.least_loaded(0)
            if server is None:
                raise ServerUnavailable(f"no inference server is up ({self.pool.down_servers()})")
            self.pool.started(server, n, group=False)
            completions = None
            try:
                completions = await server.client.generate(prompt_ids, n, self.sampling, max_tokens, seed)
                self.pool.request_succeeded(server)
                return completions
            except RequestFailed as error:
                self.pool.request_failed(server, error)
                if not isinstance(error, ServerUnavailable) or attempt == self.ATTEMPTS - 1:
                    raise
            finally:
                tokens = sum(len(c.token_ids) for c in completions) if completions else 0
                self.pool.finished(server, n, group=False, completion_tokens=tokens)
        raise AssertionError("unreachable")
