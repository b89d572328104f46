"""The environment interface: a seeded stream of examples, a rollout, and a rubric that scores it.

Rollouts talk to the policy in tokens (token-in/token-out). The first prompt is chat-templated once; after
that every turn's prompt is the previous prompt + the tokens the policy sampled + the tokens of the
environment's answer, so nothing the model produced is ever re-tokenized and the logprobs the trainer gets
belong to exactly the tokens that were sampled. Environment tokens are in the trajectory with loss_mask
False and logprob 0. docs/environments.md is the user's guide to this module.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from asyncrl.environments.rubric import Rubric

Messages = list[dict[str, Any]]
State = dict[str, Any]

EVAL_SEED = 1_000_003  # the seed of `eval_examples`; keep training seeds small to keep them apart
END_OF_TURN = "<|im_end|>"  # ChatML's end of a message; tokenizers without it end turns with their EOS


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
    max_tokens: int  # most tokens sampled in one turn
    seq_len: int | None  # longest prompt + completion the server accepts (None: no bound known)

    async def generate(self, prompt_ids: list[int], n: int, max_tokens: int | None = None) -> list[Completion]: ...


@dataclass
class TokenSample:
    """One token sequence the trainer sees. `loss_mask` is True on sampled tokens only; prompt and
    environment tokens have loss_mask False and logprob 0."""

    input_ids: list[int]
    loss_mask: list[bool]
    inference_logprobs: list[float]

    def extend(self, token_ids: list[int], logprobs: list[float] | None = None) -> None:
        """Append sampled tokens (with their logprobs) or, without logprobs, tokens outside the loss."""
        self.input_ids += token_ids
        self.loss_mask += [logprobs is not None] * len(token_ids)
        self.inference_logprobs += logprobs if logprobs is not None else [0.0] * len(token_ids)


@dataclass
class Rollout:
    """One finished episode, ready for advantages and packing.

    Usually one token sample; each turn whose chat-template rendering breaks the token prefix starts
    another (`prefix_breaks`). `completion_text` is the last assistant message: what reward functions score.
    """

    example: Example
    samples: list[TokenSample]
    messages: Messages
    policy_versions: list[int]
    completion_text: str
    finish_reason: str
    turns: int = 1
    is_truncated: bool = False
    state: State = field(default_factory=dict)
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def min_policy_version(self) -> int:
        """The oldest policy version among its tokens: what the off-policy bound is checked against."""
        return min(self.policy_versions, default=0)

    @property
    def max_policy_version(self) -> int:
        """The newest: newer than the oldest when weights changed while the episode ran."""
        return max(self.policy_versions, default=0)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.samples)

    @property
    def num_completion_tokens(self) -> int:
        return sum(sum(s.loss_mask) for s in self.samples)

    @property
    def prefix_breaks(self) -> int:
        return max(len(self.samples) - 1, 0)


@dataclass(frozen=True)
class RolloutLimits:
    """Bounds on one episode. One that is hit ends the episode early; the rollout is kept, scored and
    marked `is_truncated`."""

    max_turns: int = 10  # assistant turns
    max_tokens: int | None = None  # tokens of one token sample: prompt + sampled + environment tokens
    time_limit: float | None = None  # seconds from the first request to the last token


class Episode:
    """The token bookkeeping of one multi-turn conversation (token-in/token-out).

    Text is what the environment reads and writes; tokens are what the policy saw and sampled. The
    environment's messages are turned into tokens by rendering the conversation with and without them and
    taking the difference; the assistant's own tokens are never re-rendered. When the chat template renders
    the conversation differently once new messages are added (some templates rewrite earlier turns), the
    prefix is broken: the current sample ends and a new one starts from the template's rendering.
    """

    def __init__(self, tokenizer: Any, prompt: Messages, tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools
        self.messages: Messages = [dict(m) for m in prompt]
        self.samples = [TokenSample([], [], [])]
        self.samples[0].extend(self.render(self.messages, add_generation_prompt=True))
        self.policy_versions: list[int] = []
        self.turns = 0
        self.finish_reason = ""
        end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        self.end_of_turn = tokenizer.eos_token_id if end is None or end == tokenizer.unk_token_id else end

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> list[int]:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )

    @property
    def input_ids(self) -> list[int]:
        """The prompt of the next turn: everything in the current sample."""
        return self.samples[-1].input_ids

    def copy(self) -> Episode:
        """An independent episode in the same state (the group's episodes share their first prompt)."""
        other = copy.copy(self)
        other.messages = [dict(m) for m in self.messages]
        other.samples = [
            TokenSample(list(s.input_ids), list(s.loss_mask), list(s.inference_logprobs)) for s in self.samples
        ]
        other.policy_versions = list(self.policy_versions)
        return other

    def add_completion(self, completion: Completion) -> None:
        """Append what the policy sampled, as sampled, and its text as the assistant's message."""
        self.samples[-1].extend(completion.token_ids, completion.logprobs)
        self.policy_versions += completion.policy_versions
        self.turns += 1
        self.finish_reason = completion.finish_reason
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})

    def environment_tokens(self, new_messages: Messages) -> list[int] | None:
        """Tokens that close the assistant's turn and render `new_messages` up to the next generation
        prompt; None when the template's rendering of the longer conversation breaks the prefix."""
        before = self.render(self.messages)
        after = self.render(self.messages + new_messages, add_generation_prompt=True)
        if after[: len(before)] != before:
            return None
        # The template closes the assistant's turn with END_OF_TURN and maybe more ("\n" in ChatML).
        # A turn cut at max_tokens has no END_OF_TURN of its own: it is added, outside the loss.
        ends = [i for i, t in enumerate(before) if t == self.end_of_turn]
        close = before[ends[-1] + 1 :] if ends else []
        sampled_end = self.input_ids[-1:] == [self.end_of_turn]
        return ([] if sampled_end or not ends else [self.end_of_turn]) + close + after[len(before) :]

    def add_environment(self, new_messages: Messages, max_tokens: int | None) -> bool:
        """Append the environment's messages; False (nothing appended) when they would pass `max_tokens`."""
        tokens = self.environment_tokens(new_messages)
        if tokens is None:
            tokens = self.render(self.messages + new_messages, add_generation_prompt=True)
            if max_tokens is not None and len(tokens) >= max_tokens:
                return False
            self.samples.append(TokenSample([], [], []))
        elif max_tokens is not None and len(self.input_ids) + len(tokens) >= max_tokens:
            return False
        self.samples[-1].extend(tokens)
        self.messages += [dict(m) for m in new_messages]
        return True


class Environment:
    """Subclasses yield examples and define a rubric; override `respond` for multi-turn episodes.

    The rollout is the same for every environment: the policy answers, `respond` reads the answer and
    returns the environment's messages (a user reply, a tool result, game feedback) or None to end the
    episode. The default `respond` ends it after the first answer: a single-turn environment.
    """

    name: str = "environment"
    rubric: Rubric
    tools: list[dict] | None = None  # JSON schemas given to the chat template (`tools=`), for tool calls
    limits: RolloutLimits = RolloutLimits()

    def __init__(self, max_turns: int = 10, max_tokens: int | None = None, time_limit: float | None = None):
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.limits = RolloutLimits(max_turns, max_tokens, time_limit)

    def examples(self, seed: int) -> Iterator[Example]:
        """An endless, reproducible stream of examples: the same seed gives the same stream."""
        raise NotImplementedError

    def eval_examples(self) -> Iterator[Example]:
        """Held-out examples for evals. By default the stream of EVAL_SEED; override it when the task has
        a real held-out split (generated tasks may repeat an example across seeds)."""
        return self.examples(EVAL_SEED)

    async def respond(self, messages: Messages, state: State, example: Example) -> Messages | None:
        """The environment's answer to the assistant's last message (`messages[-1]`), or None when the
        episode is over. `state` starts empty for each episode; keep in it what later turns and reward
        functions need."""
        return None

    async def rollout_group(self, example: Example, policy: Policy, group_size: int) -> list[Rollout]:
        """Play `group_size` episodes of one example and score each. The first turn is one request for
        `group_size` samples (the prompt is prefilled once); later turns go on independently."""
        deadline = None if self.limits.time_limit is None else time.monotonic() + self.limits.time_limit
        budget = min((b for b in (self.limits.max_tokens, policy.seq_len) if b is not None), default=None)
        start = Episode(policy.tokenizer, example.prompt, self.tools)
        completions = await _sample(policy, start.input_ids, group_size, budget, deadline)
        if completions is None:  # no room left for a first answer (time limit or token budget)
            return [await self._finish(start.copy(), example, {}, truncated=True) for _ in range(group_size)]
        plays = [self._play(start.copy(), c, example, policy, budget, deadline) for c in completions]
        return list(await asyncio.gather(*plays))

    async def _play(
        self,
        episode: Episode,
        completion: Completion,
        example: Example,
        policy: Policy,
        budget: int | None,
        deadline: float | None,
    ) -> Rollout:
        state: State = {}
        while True:
            episode.add_completion(completion)
            try:
                remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                reply = await asyncio.wait_for(self.respond(episode.messages, state, example), remaining)
            except TimeoutError:
                return await self._finish(episode, example, state, truncated=True)
            except Exception as e:  # noqa: BLE001 - a failing environment marks the rollout, never the run
                return await self._finish(episode, example, state, error=f"respond {type(e).__name__}: {e}")
            if reply is None:
                cut = episode.finish_reason == "length"
                return await self._finish(episode, example, state, truncated=cut)
            if episode.turns >= self.limits.max_turns or not episode.add_environment(reply, budget):
                return await self._finish(episode, example, state, truncated=True)
            sampled = await _sample(policy, episode.input_ids, 1, budget, deadline)
            if sampled is None:
                return await self._finish(episode, example, state, truncated=True)
            completion = sampled[0]

    async def _finish(
        self, episode: Episode, example: Example, state: State, truncated: bool = False, error: str | None = None
    ) -> Rollout:
        last = episode.messages[-1]
        text = last["content"] if last["role"] == "assistant" else ""
        score = await self.rubric.score(text, example, state) if error is None else None
        return Rollout(
            example=example,
            samples=episode.samples,
            messages=episode.messages,
            policy_versions=episode.policy_versions,
            completion_text=text,
            finish_reason=episode.finish_reason,
            turns=episode.turns,
            is_truncated=truncated,
            state=state,
            reward=score.reward if score else 0.0,
            metrics=score.metrics if score else {},
            error=score.error if score else error,
        )


async def _sample(
    policy: Policy, prompt_ids: list[int], n: int, budget: int | None, deadline: float | None
) -> list[Completion] | None:
    """`n` completions within the token budget and the time limit; None when neither leaves room."""
    max_tokens = policy.max_tokens if budget is None else min(policy.max_tokens, budget - len(prompt_ids))
    remaining = None if deadline is None else deadline - time.monotonic()
    if max_tokens < 1 or (remaining is not None and remaining <= 0):
        return None
    try:
        return await asyncio.wait_for(policy.generate(prompt_ids, n, max_tokens), remaining)
    except TimeoutError:
        return None
