"""The environment interface: a seeded stream of examples, a rollout, and a rubric that scores it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

Messages = list[dict[str, str]]


@dataclass
class Example:
    """One task: the prompt the policy sees, the reference answer (for SFT data and rewards), and
    anything else the reward needs."""

    prompt: Messages
    answer: str
    info: dict[str, Any] = field(default_factory=dict)

    def sft_messages(self) -> Messages:
        return [*self.prompt, {"role": "assistant", "content": self.answer}]


class Environment:
    """Subclasses yield examples and define `rubric`; single-turn rollouts need nothing else."""

    name: str = "environment"

    def examples(self, seed: int) -> Iterator[Example]:
        """An endless, reproducible stream of examples: the same seed gives the same stream."""
        raise NotImplementedError
