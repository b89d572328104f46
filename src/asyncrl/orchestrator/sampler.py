"""Which environment, and which of its examples, each group of a batch gets.

Environments share every batch by weight. The choice is deterministic: the next group goes to the
environment furthest behind its share, `weight / total weight × groups drawn so far` (smooth weighted round
robin), so the groups drawn from each environment stay within one group of its share, with no randomness
to restore.
Each environment's examples come from its own reproducible stream `env.examples(seed)`.

So the sampler's whole state is the number of examples drawn from each environment: `state_dict()` gives it
as `{"drawn": {label: count}}` (JSON-ready) and `load_state_dict()` on a fresh sampler of the same config
skips each stream to that point, after which it draws exactly what the saved sampler would have drawn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from asyncrl.environments.base import Environment, Example
from asyncrl.errors import AsyncRLError


class EnvironmentSampler:
    def __init__(self, environments: dict[str, Environment], weights: dict[str, float], seed: int):
        self.environments = environments
        self.shares = {label: weights[label] / sum(weights.values()) for label in environments}
        self.streams: dict[str, Iterator[Example]] = {label: env.examples(seed) for label, env in environments.items()}
        self.drawn = dict.fromkeys(environments, 0)

    def labels(self, groups: int) -> list[str]:
        """The environments of the next `groups` groups."""
        drawn, labels = dict(self.drawn), []
        for _ in range(groups):
            total = sum(drawn.values()) + 1
            label = max(self.environments, key=lambda label: self.shares[label] * total - drawn[label])
            drawn[label] += 1
            labels.append(label)
        return labels

    def draw(self, groups: int) -> list[tuple[str, Example]]:
        """The next `groups` (environment label, example) pairs."""
        drawn = []
        for label in self.labels(groups):
            drawn.append((label, self._next(label)))
            self.drawn[label] += 1
        return drawn

    async def draw_in_thread(self, groups: int) -> list[tuple[str, Example]]:
        """`draw(groups)`, the streams read in a thread: a stream may wait on an env-server's answer or a file,
        and the dispatcher draws on the event loop. One call at a time. The counts move only once the examples
        are here, so a checkpoint taken meanwhile holds the streams before them, and a run resumed from it
        draws them again rather than losing them."""
        labels = self.labels(groups)
        examples = await asyncio.to_thread(lambda: [self._next(label) for label in labels])
        for label in labels:
            self.drawn[label] += 1
        return list(zip(labels, examples))

    def _next(self, label: str) -> Example:
        example = next(self.streams[label], None)
        if example is None:  # a finite stream (a file read once): say so, rather than end the run mid-batch
            raise AsyncRLError(
                f"environment '{label}' ran out of examples after {self.drawn[label]} (its examples() stream "
                "ended); give it more epochs (the dataset environment: args.epochs, unset for endless), or lower "
                "max_steps"
            )
        return example

    def state_dict(self) -> dict:
        return {"drawn": dict(self.drawn)}

    def load_state_dict(self, state: dict) -> None:
        """Skip every stream to where the saved sampler was; the saved labels must match this config's."""
        drawn = state["drawn"]
        if set(drawn) != set(self.environments):
            raise ValueError(
                f"saved environments {sorted(drawn)} differ from the configured {sorted(self.environments)}"
            )
        for label, count in drawn.items():
            if count < self.drawn[label]:
                raise ValueError(f"environment '{label}' is already past example {count}")
            for _ in range(count - self.drawn[label]):
                self._next(label)
                self.drawn[label] += 1
