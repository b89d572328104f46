"""Finished groups waiting for a trainer batch, oldest first.

A group joins the queue once all its episodes are over and scored and its advantages are computed, so
the queue holds exactly what a batch is made of. Its rollouts keep the oldest policy version among their
tokens; when the bound moves on (a batch was cut), rollouts too old for any later batch leave the queue
and are counted as dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from asyncrl.environments.base import Example, Rollout
from asyncrl.orchestrator.advantages import carries_signal


@dataclass
class ScoredGroup:
    """The scored rollouts of one example, with their advantages (rollout i has advantages[i])."""

    index: int  # the run's n-th group drawn (0-based): its seed and its order in a batch
    label: str  # the environment it came from
    example: Example
    rollouts: list[Rollout]
    advantages: list[float]
    dispatched_at: float = 0.0  # wall-clock seconds when it was (last) sent to a server
    finished_at: float = 0.0
    server: str = ""  # the URL of the server that generated it
    dropped: int = field(default=0)  # rollouts left out as too old

    @property
    def num_rollouts(self) -> int:
        return len(self.rollouts)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rollouts)

    @property
    def carries_signal(self) -> bool:
        return carries_signal(self.advantages)

    def drop_older_than(self, version: int) -> int:
        """Leave out the rollouts with a token older than `version`; returns how many left. A rollout without
        a sampled token (its episode ended before its first answer) has none: it stays."""
        kept = [
            (r, a)
            for r, a in zip(self.rollouts, self.advantages)
            if r.min_policy_version >= version or not r.policy_versions
        ]
        dropped = len(self.rollouts) - len(kept)
        self.rollouts, self.advantages = [r for r, _ in kept], [a for _, a in kept]
        self.dropped += dropped
        return dropped


class RolloutQueue:
    """Scored groups in the order they finished; a batch takes whole groups from the front."""

    def __init__(self, groups: list[ScoredGroup] | None = None):
        self._groups: deque[ScoredGroup] = deque(groups or ())

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[ScoredGroup]:
        return iter(self._groups)

    @property
    def rollouts(self) -> int:
        return sum(g.num_rollouts for g in self._groups)

    @property
    def tokens(self) -> int:
        return sum(g.num_tokens for g in self._groups)

    def put(self, group: ScoredGroup) -> None:
        self._groups.append(group)

    def drop_older_than(self, version: int) -> int:
        """Drop every queued rollout with a token older than `version` (a group left empty goes too);
        returns how many were dropped."""
        dropped = sum(g.drop_older_than(version) for g in self._groups)
        self._groups = deque(g for g in self._groups if g.rollouts)
        return dropped

    def take(self, rollouts: int | None = None, tokens: int | None = None) -> list[ScoredGroup] | None:
        """Whole groups from the front until they hold `rollouts` rollouts (or `tokens` tokens); None, taking
        nothing, while the queue holds fewer."""
        if (self.rollouts if tokens is None else self.tokens) < (rollouts if tokens is None else tokens):
            return None
        taken, count = [], 0
        while count < (rollouts if tokens is None else tokens):
            group = self._groups.popleft()
            taken.append(group)
            count += group.num_rollouts if tokens is None else group.num_tokens
        return taken
