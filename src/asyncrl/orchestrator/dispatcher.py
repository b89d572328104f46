"""Continuous dispatch: groups go out to the inference pool as long as there is room, with no barrier
between batches.

Room is bounded twice:
- at most `max_inflight` groups are in flight across all servers;
- the off-policy bound: a group sent to a server with policy version v can only go into batches
  n <= v + 1 + max_async_level. With `cut` batches already cut, that leaves (v + 1 + max_async_level - cut)
  batches of room, less what is already queued or in flight. So at max_async_level 0 exactly one batch is
  sent out once the trainer's newest weights are live (lockstep); at 1, the next batch is generated while
  the trainer trains on this one, and weights that go live meanwhile make room for one more.

When a batch is cut the bound moves on: a group in flight that was sent to a server older than the next
batch allows can no longer be used, and is cancelled (the server drops its requests). A group whose
server went down is sent again, first, to another server, with the same seed. A finished group gets its
advantages and joins the queue; with `dynamic_sampling`, one whose rewards are all equal (no signal) is
left out instead, and another example is drawn in its place.

A group whose request failed (the client classifies why, see client.py) is decided on here:
- rejected by the server (HTTP 4xx): the group fails; it is counted, reported in one line, left out, and
  another example is drawn in its place;
- by the server's fault (5xx, connection, timeout): it is sent again, first, with the same seed, to
  another server, or after a backoff (RETRY_BACKOFF doubling up to RETRY_BACKOFF_MAX) to the same one when
  no other serves; after GROUP_ATTEMPTS such failures it fails too.
The run stops when more than `max_failed_fraction` of the groups that ended since the last cut failed,
counted over at least one batch's worth (batch_size / group_size groups).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.config.schema import OrchestratorConfig
from asyncrl.environments.base import Environment, Example, Rollout
from asyncrl.errors import AsyncRLError
from asyncrl.orchestrator.advantages import group_advantages
from asyncrl.orchestrator.batch import min_policy_version
from asyncrl.orchestrator.checkpoint import group_seed
from asyncrl.orchestrator.client import RequestFailed, ServedPolicy, ServerUnavailable
from asyncrl.orchestrator.notify import Notifier
from asyncrl.orchestrator.pool import InferencePool, Server
from asyncrl.orchestrator.queue import RolloutQueue, ScoredGroup
from asyncrl.orchestrator.sampler import EnvironmentSampler

log = logging.getLogger("asyncrl.orchestrator")

# Dynamic sampling gives up filtering for the rest of a batch after this many batches' worth of groups in a
# row without signal (a solved or hopeless task would otherwise draw forever).
FILTER_LIMIT_BATCHES = 8
GROUP_ATTEMPTS = 5  # sends of one group whose requests fail by the server's fault, before the group fails
RETRY_BACKOFF, RETRY_BACKOFF_MAX = 0.5, 8.0  # seconds before a group goes again to the server it failed on


@dataclass(eq=False)
class GroupTicket:
    """One example on its way to becoming a scored group."""

    index: int  # the run's n-th group drawn: it fixes the seed, so a group sent again samples the same
    label: str
    example: Example
    seed: int
    server: Server | None = None
    version: int = 0  # the policy version its server held when it was sent
    dispatched_at: float = 0.0
    task: asyncio.Task | None = None
    attempts: int = 0  # sends that failed by the server's fault
    failed_on: Server | None = None  # the server of the last of them
    retry_at: float = 0.0  # time.monotonic() before which it goes nowhere but to another server


def prompt_preview(example: Example, chars: int = 60) -> str:
    """The start of an example's last prompt message, to name the example in a message."""
    text = str(example.prompt[-1].get("content", "")) if example.prompt else ""
    return repr(text[:chars] + ("…" if len(text) > chars else ""))


def dispatch_room(cut: int, version: int, max_async_level: int, batch: float, committed: float) -> float:
    """What may still be sent to a server holding policy `version`, in the unit of `batch` (rollouts or
    tokens): the batches it may still feed, less what is queued or in flight."""
    return (version + 1 + max_async_level - cut) * batch - committed


def score_group(ticket: GroupTicket, rollouts: list[Rollout], cfg: OrchestratorConfig) -> ScoredGroup:
    """Advantages within the group, by its environment's settings, over the rollouts that were scored;
    an errored rollout gets 0 (it is left out of the batch's samples)."""
    scored = [i for i, r in enumerate(rollouts) if r.error is None]
    advantages = [0.0] * len(rollouts)
    if scored:
        rewards = [rollouts[i].reward for i in scored]
        lengths = [rollouts[i].num_completion_tokens for i in scored]
        for i, advantage in zip(scored, group_advantages(rewards, lengths, cfg.environments[ticket.label].advantage)):
            advantages[i] = advantage
    server = ticket.server.url if ticket.server else ""
    return ScoredGroup(
        ticket.index, ticket.label, ticket.example, rollouts, advantages, ticket.dispatched_at, time.time(), server
    )


class Dispatcher:
    def __init__(
        self,
        cfg: OrchestratorConfig,
        pool: InferencePool,
        environments: dict[str, Environment],
        sampler: EnvironmentSampler,
        policy: Callable[[Server], ServedPolicy],
        queue: RolloutQueue,
        notifier: Notifier,
        cut: int = 0,
        next_index: int = 0,
        pending: list[GroupTicket] | None = None,
        version_floor: int = 0,
    ):
        self.cfg = cfg
        self.pool = pool
        self.environments = environments
        self.sampler = sampler
        self.policy = policy
        self.queue = queue
        self.notifier = notifier
        self.cut = cut  # batches cut so far
        self.next_index = next_index
        # Drawn, not in flight: sent again after a failure or a server gone down, or just drawn; oldest first.
        self.unsent: deque[GroupTicket] = deque(sorted(pending or (), key=lambda t: t.index))
        # A resumed run's servers start on the base model, which a loose bound may allow: no group goes to a
        # server older than those of the interrupted run when its checkpoint was taken.
        self.version_floor = version_floor
        self.inflight: dict[int, GroupTicket] = {}
        self.error: BaseException | None = None  # a failure that must stop the run
        self.waiting_for_version: int | None = None  # set while the bound holds dispatch back
        self._mean_group_tokens: float | None = None
        self._filtering = True
        self._stats = self._zero_stats()
        self._blocked_since: float | None = None
        self._ended = 0  # groups finished, left out or failed since the last cut
        self._failed = 0  # of those, failed

    @staticmethod
    def _zero_stats() -> dict[str, float]:
        return {
            "dispatched": 0, "cancelled": 0, "redispatched": 0, "retried": 0, "failed": 0, "filtered": 0,
            "blocked": 0.0,
        }  # fmt: skip

    # ---- the loop ----

    async def run(self) -> None:
        """Forever: send out what there is room for, then wait for something to change."""
        while self.error is None:
            self._reclaim_groups_of_down_servers()
            while self.error is None and (choice := self._next()) is not None:
                ticket, server = choice
                if ticket is None:
                    # As many as there is room for, drawn at once so that they go out together. The loop runs on
                    # meanwhile and the room may change: they take their turn among the unsent tickets (counted
                    # as committed from now on).
                    count = min(self._groups_with_room(server), self.cfg.max_inflight - len(self.inflight))
                    self.unsent.extend(await self._draw(count))
                    continue
                self._send(ticket, server)
            backoff = self.unsent[0].retry_at - time.monotonic() if self.unsent else 0.0
            await self.notifier.wait(backoff if 0 < backoff < 1 else 1.0)
        raise self.error

    def _next(self) -> tuple[GroupTicket | None, Server] | None:
        """The next ticket and the server it goes to (no ticket: draw a new one), or None when there is no
        room."""
        blocked = False
        choice = None
        if len(self.inflight) < self.cfg.max_inflight:
            oldest_useful = max(min_policy_version(self.cut + 1, self.cfg.max_async_level), self.version_floor)
            servers = self.pool.by_preference(oldest_useful)
            if not servers:
                blocked = any(s.up for s in self.pool.servers)  # up, but weights too old for the next batch
                self.waiting_for_version = oldest_useful if blocked else None
            elif self.unsent:
                elsewhere = self.pool.least_loaded(oldest_useful, avoid=self.unsent[0].failed_on)
                if elsewhere is not None:
                    choice = (self.unsent.popleft(), elsewhere)
                elif time.monotonic() >= self.unsent[0].retry_at:
                    choice = (self.unsent.popleft(), servers[0])
                # else: it backs off from the only server that serves, and nothing new goes there meanwhile
            else:
                # Room depends on the server's weights: the least loaded one may be a version behind (still
                # updating) while another, already newer, may take the next batch's groups.
                with_room = next((s for s in servers if self._groups_with_room(s)), None)
                if with_room is not None:
                    choice = (None, with_room)
                else:
                    blocked = True
                    self.waiting_for_version = min(s.version for s in servers) + 1
        now = time.monotonic()
        if self._blocked_since is not None:
            self._stats["blocked"] += now - self._blocked_since
        self._blocked_since = now if blocked else None
        if not blocked:
            self.waiting_for_version = None
        return choice

    def _groups_with_room(self, server: Server) -> int:
        """How many more groups `server` may take under the bound, counting what is queued, in flight or
        unsent."""
        pending = len(self.inflight) + len(self.unsent)
        if self.cfg.batch_tokens is None:
            committed = self.queue.rollouts + pending * self.cfg.group_size
            room = dispatch_room(self.cut, server.version, self.cfg.max_async_level, self.cfg.batch_size, committed)
            return max(int(room // self.cfg.group_size), 0)
        # By tokens, what is in flight is an estimate (the mean finished group so far); sending one group while
        # anything is left keeps a batch from waiting on a too-high estimate.
        estimate = self._mean_group_tokens or 0.0
        committed = self.queue.tokens + pending * estimate
        room = dispatch_room(self.cut, server.version, self.cfg.max_async_level, self.cfg.batch_tokens, committed)
        return int(room > 0)

    async def _draw(self, count: int) -> list[GroupTicket]:
        tickets = []
        for label, example in await self.sampler.draw_in_thread(count):
            tickets.append(GroupTicket(self.next_index, label, example, group_seed(self.cfg.seed, self.next_index)))
            self.next_index += 1
        return tickets

    def _send(self, ticket: GroupTicket, server: Server) -> None:
        ticket.server, ticket.version, ticket.dispatched_at = server, server.version, time.time()
        self.inflight[ticket.index] = ticket
        self.pool.started(server, self.cfg.group_size, group=True)
        ticket.task = asyncio.create_task(self._play(ticket), name=f"group-{ticket.index}")
        self._stats["dispatched"] += 1

    async def _play(self, ticket: GroupTicket) -> None:
        server = ticket.server
        env = self.environments[ticket.label]
        rollouts = None
        try:
            rollouts = await env.rollout_group(
                ticket.example, self.policy(server).seeded(ticket.seed), self.cfg.group_size
            )
            self.pool.request_succeeded(server)
        except RequestFailed as error:
            self.pool.request_failed(server, error)
            if self.inflight.get(ticket.index) is ticket:
                self._request_failed(ticket, error)
        except asyncio.CancelledError:
            pass  # whoever cancelled it has dealt with the ticket
        except Exception as error:  # noqa: BLE001 - anything else is a bug or a broken environment: stop the run
            self.error = error
        finally:
            done = self.inflight.get(ticket.index) is ticket and rollouts is not None
            if done:
                del self.inflight[ticket.index]
            tokens = sum(r.num_completion_tokens for r in rollouts) if rollouts else 0
            self.pool.finished(server, self.cfg.group_size, group=True, completion_tokens=tokens)
        if done:
            self._finish(score_group(ticket, rollouts, self.cfg))

    def _request_failed(self, ticket: GroupTicket, error: RequestFailed) -> None:
        """A request of the group failed: send the group again (the server's fault) or let it fail."""
        del self.inflight[ticket.index]
        if isinstance(error, ServerUnavailable) and ticket.attempts + 1 < GROUP_ATTEMPTS:
            ticket.attempts += 1
            ticket.failed_on = ticket.server
            ticket.retry_at = time.monotonic() + min(RETRY_BACKOFF * 2 ** (ticket.attempts - 1), RETRY_BACKOFF_MAX)
            self.unsent.appendleft(ticket)
            self._stats["retried"] += 1
            log.info("group %d sent again after attempt %d failed: %s", ticket.index, ticket.attempts, error)
            return
        self._stats["failed"] += 1
        self._ended += 1
        self._failed += 1
        print(
            f"orchestrator: group {ticket.index} ({ticket.label}, prompt {prompt_preview(ticket.example)}) failed "
            f"({error.reason}) and is left out: {error}",
            flush=True,
        )
        groups_per_batch = self.cfg.batch_size // self.cfg.group_size
        if self._failed > self.cfg.max_failed_fraction * max(self._ended, groups_per_batch):
            self.error = AsyncRLError(
                f"{self._failed} of the {self._ended} groups that ended since batch {self.cut} was cut failed, more "
                f"than orchestrator.max_failed_fraction = {self.cfg.max_failed_fraction} of them; the last: {error}"
            )
            self.notifier.notify()

    def _finish(self, group: ScoredGroup) -> None:
        self._ended += 1
        tokens = group.num_tokens
        self._mean_group_tokens = (
            tokens if self._mean_group_tokens is None else 0.9 * self._mean_group_tokens + 0.1 * tokens
        )
        if self.cfg.dynamic_sampling and self._filtering and not group.carries_signal:
            self._stats["filtered"] += 1
            if self._stats["filtered"] >= FILTER_LIMIT_BATCHES * self.cfg.batch_size // self.cfg.group_size:
                self._filtering = False
                print(
                    f"orchestrator: dynamic sampling left out {self._stats['filtered']:.0f} groups without signal "
                    "since the last batch; taking every group until the batch is cut",
                    flush=True,
                )
            return
        self.queue.put(group)
        self.notifier.notify()

    def _resend(self, ticket: GroupTicket) -> None:
        """The ticket's server went down: take the group back, to send it again first."""
        del self.inflight[ticket.index]
        self.unsent.appendleft(ticket)
        self._stats["redispatched"] += 1

    def _reclaim_groups_of_down_servers(self) -> None:
        for ticket in [t for t in self.inflight.values() if not t.server.up]:
            self._resend(ticket)
            ticket.task.cancel()
        self.unsent = deque(sorted(self.unsent, key=lambda t: t.index))

    # ---- the batch loop's side ----

    def batch_cut(self, step: int) -> None:
        """Batch `step` was cut: cancel the groups in flight that no later batch may take."""
        self.cut = step
        self._filtering = True
        self._ended = self._failed = 0
        oldest = min_policy_version(step + 1, self.cfg.max_async_level)
        for ticket in [t for t in self.inflight.values() if t.version < oldest]:
            del self.inflight[ticket.index]
            ticket.task.cancel()
            self._stats["cancelled"] += 1
        self.notifier.notify()

    def take_stats(self) -> dict[str, Any]:
        """Dispatch metrics since the last call (one batch)."""
        stats, self._stats = self._stats, self._zero_stats()
        return {
            "groups/dispatched": stats["dispatched"],
            "groups/cancelled": stats["cancelled"],
            "groups/redispatched": stats["redispatched"],
            "groups/retried": stats["retried"],
            "groups/failed": stats["failed"],
            "batch/filtered_groups": stats["filtered"],
            "time/wait_for_weights": stats["blocked"],
            "groups/in_flight": len(self.inflight),
        }

    def pending(self) -> list[GroupTicket]:
        """Groups drawn but not finished (in flight or waiting to be sent again), oldest first: a checkpoint
        keeps them, so that a resumed run sends them again instead of losing their examples."""
        return sorted([*self.inflight.values(), *self.unsent], key=lambda t: t.index)

    def describe(self) -> str:
        """What dispatch is waiting for, for a message that explains a stall."""
        parts = [f"{len(self.inflight)} group(s) in flight", f"{self.queue.rollouts} rollout(s) queued"]
        if not any(s.up for s in self.pool.servers):
            parts.append(f"no inference server is up ({self.pool.down_servers()})")
        elif self.waiting_for_version is not None:
            parts.append(
                f"dispatch waits for policy version {self.waiting_for_version} from the trainer (is it running?)"
            )
        return ", ".join(parts)
