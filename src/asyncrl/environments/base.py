"""The environment interface: a seeded stream of examples, a rollout, and a rubric that scores it.

Rollouts talk to the policy in tokens: the environment builds the prompt token ids once and the policy
returns the sampled token ids with their logprobs, so nothing the model produced is ever re-tokenized.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from asyncrl.environments.rubric import Rubric

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


@dataclass
class Completion:
    """What the policy sampled for one prompt: tokens, their logprobs at the sampling temperature, and the
    policy version that produced each token."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str


class Policy(Protocol):
    """The served model as environments see it."""

    tokenizer: Any
    temperature: float

    async def generate(self, prompt_ids: list[int], n: int) -> list[Completion]: ...


@dataclass
class Rollout:
    """One finished episode, ready for advantages and packing. `loss_mask` marks sampled tokens."""

    example: Example
    input_ids: list[int]
    loss_mask: list[bool]
    inference_logprobs: list[float]
    policy_versions: list[int]
    completion_text: str
    finish_reason: str
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def min_policy_version(self) -> int:
        return min(self.policy_versions, default=0)

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.loss_mask)


class Environment:
    """Subclasses yield examples and define a rubric; the default rollout is single-turn."""

    name: str = "environment"
    rubric: Rubric

    def examples(self, seed: int) -> Iterator[Example]:
        """An endless, reproducible stream of examples: the same seed gives the same stream."""
        raise NotImplementedError

    async def rollout_group(self, example: Example, policy: Policy, group_size: int) -> list[Rollout]:
        """Sample `group_size` answers to one prompt (one request, so the prompt is prefilled once) and score
        each."""
        prompt_ids = policy.tokenizer.apply_chat_template(
            example.prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        rollouts = []
        for completion in await policy.generate(prompt_ids, group_size):
            text = policy.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            score = await self.rubric.score(text, example)
            rollouts.append(
                Rollout(
                    example=example,
                    input_ids=prompt_ids + completion.token_ids,
                    loss_mask=[False] * len(prompt_ids) + [True] * len(completion.token_ids),
                    inference_logprobs=[0.0] * len(prompt_ids) + completion.logprobs,
                    policy_versions=completion.policy_versions,
                    completion_text=text,
                    finish_reason=completion.finish_reason,
                    reward=score.reward,
                    metrics=score.metrics,
                    error=score.error,
                )
            )
        return rollouts
