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
import inspect
import time
from collections.abc import Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from asyncrl.errors import AsyncRLError
from asyncrl.transport.routing import unrecorded

if TYPE_CHECKING:
    from asyncrl.environments.rubric import Rubric, Score

Messages = list[dict[str, Any]]
State = dict[str, Any]

EVAL_SEED = 1_000_003  # the seed of `eval_examples`; keep training seeds small to keep them apart
END_OF_TURN = "<|im_end|>"  # ChatML's end of a message; tokenizers without it end turns with their EOS
T = TypeVar("T")


@dataclass
class Example:
    """One task: the prompt the policy sees, the reference answer (for SFT data and rewards), and
    anything else the reward needs."""

    prompt: Messages
    answer: str
    info: dict[str, Any] = field(default_factory=dict)
    # A worked episode after the prompt, for SFT: assistant answers and the environment's messages between them
    # (a tool call, its result, the final answer). None: the episode is one assistant message, `answer`.
    demonstration: Messages | None = None

    def sft_messages(self) -> Messages:
        return [*self.prompt, *(self.demonstration or [{"role": "assistant", "content": self.answer}])]


@dataclass
class Completion:
    """What the policy sampled for one prompt: tokens, their logprobs at the sampling temperature, and the
    policy version that produced each token; for router replay, the experts every token of the prompt and of
    the completion was routed to (int16 [tokens, MoE layers, k], transport/routing.py); the prompt tokens the
    server read from its prefix cache instead of computing them (a later turn's: the turns before it)."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str
    prompt_routed_experts: np.ndarray | None = None
    routed_experts: np.ndarray | None = None
    cached_tokens: int = 0


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
    environment tokens have loss_mask False and logprob 0. With router replay, `routed_experts` holds the
    experts each token went to in the engine's latest pass over it (-1: not recorded)."""

    input_ids: list[int]
    loss_mask: list[bool]
    inference_logprobs: list[float]
    routed_experts: np.ndarray | None = None

    def extend(self, token_ids: list[int], logprobs: list[float] | None = None) -> None:
        """Append sampled tokens (with their logprobs) or, without logprobs, tokens outside the loss."""
        self.input_ids += token_ids
        self.loss_mask += [logprobs is not None] * len(token_ids)
        self.inference_logprobs += logprobs if logprobs is not None else [0.0] * len(token_ids)
        if self.routed_experts is not None:
            self.routed_experts = np.concatenate([self.routed_experts, unrecorded(len(token_ids), self.routed_experts)])

    def record_routing(self, completion: Completion) -> None:
        """The routing of the prompt just sent (this sample so far, as the engine's prefill routed it now) and of
        the completion appended to it."""
        if completion.routed_experts is None or completion.prompt_routed_experts is None:
            return
        prompt = completion.prompt_routed_experts
        end = len(self.input_ids) - len(completion.token_ids)
        known = prompt[:end] if len(prompt) >= end else np.concatenate([prompt, unrecorded(end - len(prompt), prompt)])
        self.routed_experts = np.concatenate([known, completion.routed_experts])


@dataclass
class Rollout:
    """One finished episode, ready for advantages and packing.

    Usually one token sample; each turn whose chat-template rendering breaks the token prefix starts
    another (`prefix_breaks`); none when the episode was played in messages (the evals' chat route).
    `completion_text` is the last assistant message: what reward functions score.
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
    prompt_tokens: int = 0  # prompt tokens its requests had prefilled (a group's shared first prompt: once)
    cached_tokens: int = 0  # of those, the ones the server read from its prefix cache
    # Wall time of its scoring (`Environment.score`: the rubric's reward functions, or an env-server's /score
    # round trip); 0 where an environment builds its rollouts itself (verifiers) and scores them on its own.
    score_seconds: float = 0.0

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


class Conversation(Protocol):
    """One episode's conversation as the episode loop (`Environment.play`) sees it. `Episode` keeps it in
    tokens with the policy (training, and evals over the token route); the evals' chat route keeps it in
    messages with an OpenAI-compatible server."""

    messages: Messages  # the whole conversation; the last message is the assistant's latest answer
    turns: int  # assistant answers so far
    finish_reason: str  # of the latest answer: "stop", or "length" when it was cut at max_tokens
    samples: list[TokenSample]  # what the trainer sees (none at message level)
    policy_versions: list[int]  # per sampled token (none at message level)
    prompt_tokens: int  # prompt tokens its requests sent to be prefilled (0 at message level)
    cached_tokens: int  # of those, the ones the server read from its prefix cache

    def add_environment(self, new_messages: Messages) -> bool:
        """Append the environment's messages; False (nothing appended) when they leave no room."""
        ...

    async def next_answer(self) -> bool:
        """Sample the policy's next answer and append it; False when no room or time is left for one."""
        ...


class Episode:
    """The token bookkeeping of one multi-turn conversation with the policy (token-in/token-out).

    Text is what the environment reads and writes; tokens are what the policy saw and sampled. The
    environment's messages are turned into tokens by rendering the conversation with and without them and
    taking the difference; the assistant's own tokens are never re-rendered. When the chat template renders
    the conversation differently once new messages are added (some templates rewrite earlier turns), the
    prefix is broken: the current sample ends and a new one starts from the template's rendering.

    `max_tokens` bounds one token sample (the environment's limit and the server's `seq_len`); `deadline`
    (time.monotonic) is the episode's time limit.

    Rendering a long conversation through a chat template takes milliseconds of Python (Jinja, then the
    tokenizer), twice a turn, for every episode at once: the episode loop builds an `Episode` and adds the
    environment's messages in a thread (`asyncio.to_thread`), so the event loop that runs every other episode,
    and the orchestrator's dispatch, never waits on a template. The tokenizer is shared by those threads,
    which is safe as long as nobody changes its truncation or padding settings (HF fast tokenizers).
    """

    def __init__(
        self,
        policy: Policy,
        prompt: Messages,
        tools: list[dict] | None = None,
        max_tokens: int | None = None,
        deadline: float | None = None,
    ):
        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.tools = tools
        self.max_tokens = max_tokens
        self.deadline = deadline
        self.messages: Messages = [dict(m) for m in prompt]
        self.samples = [TokenSample([], [], [])]
        self.samples[0].extend(self.render(self.messages, add_generation_prompt=True))
        self.policy_versions: list[int] = []
        self.turns = 0
        self.finish_reason = ""
        self.prompt_tokens = 0
        self.cached_tokens = 0
        end = self.tokenizer.convert_tokens_to_ids(END_OF_TURN)
        self.end_of_turn = self.tokenizer.eos_token_id if end is None or end == self.tokenizer.unk_token_id else end

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
            TokenSample(list(s.input_ids), list(s.loss_mask), list(s.inference_logprobs), s.routed_experts)
            for s in self.samples
        ]
        other.policy_versions = list(self.policy_versions)
        return other

    async def first_answers(self, group_size: int) -> list[Episode]:
        """`group_size` copies of this episode, each with its own first answer, sampled in one request (the
        prompt is prefilled once); none when no room or time is left for an answer."""
        completions = await self._sample(group_size)
        episodes = [self.copy() for _ in completions or ()]
        for episode, completion in zip(episodes, completions or ()):
            episode.add_completion(completion)
        if episodes:  # the shared prompt was prefilled once: the first episode counts it
            episodes[0].prompt_tokens += len(self.input_ids)
        return episodes

    async def next_answer(self) -> bool:
        prompt_tokens = len(self.input_ids)
        sampled = await self._sample(1)
        if sampled is None:
            return False
        self.prompt_tokens += prompt_tokens
        self.add_completion(sampled[0])
        return True

    async def _sample(self, n: int) -> list[Completion] | None:
        """`n` completions within the token budget and the time limit; None when neither leaves room."""
        budget = self.policy.max_tokens
        if self.max_tokens is not None:
            budget = min(budget, self.max_tokens - len(self.input_ids))
        remaining = remaining_time(self.deadline)
        if budget < 1 or (remaining is not None and remaining <= 0):
            return None
        try:
            return await asyncio.wait_for(self.policy.generate(self.input_ids, n, budget), remaining)
        except TimeoutError:
            return None

    def add_completion(self, completion: Completion) -> None:
        """Append what the policy sampled, as sampled, and its text as the assistant's message."""
        self.samples[-1].extend(completion.token_ids, completion.logprobs)
        self.samples[-1].record_routing(completion)
        self.policy_versions += completion.policy_versions
        self.cached_tokens += completion.cached_tokens
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

    def add_environment(self, new_messages: Messages) -> bool:
        """Append the environment's messages; False (nothing appended) when they would pass `max_tokens`."""
        tokens = self.environment_tokens(new_messages)
        if tokens is None:
            tokens = self.render(self.messages + new_messages, add_generation_prompt=True)
            if self.max_tokens is not None and len(tokens) >= self.max_tokens:
                return False
            self.samples.append(TokenSample([], [], []))
        elif self.max_tokens is not None and len(self.input_ids) + len(tokens) >= self.max_tokens:
            return False
        self.samples[-1].extend(tokens)
        self.messages += [dict(m) for m in new_messages]
        return True


async def all_or_none(coroutines: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Their results, run concurrently; the first that raises cancels the others and its error is raised
    (itself, not an ExceptionGroup). A group's episodes run so: one that fails (its request rejected, its
    server gone) fails the group, and none plays on for nobody."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(coroutine) for coroutine in coroutines]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


def remaining_time(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


class Environment:
    """Subclasses yield examples and define a rubric; override `respond` for multi-turn episodes.

    The episode loop (`play`) is the same for every environment and every route: the policy answers,
    `respond` reads the answer and returns the environment's messages (a user reply, a tool result, game
    feedback) or None to end the episode. The default `respond` ends it after the first answer: a single-turn
    environment.
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
        """A reproducible stream of examples: the same seed gives the same stream. Endless, or finite (a
        run that draws past its end stops with a message naming the environment)."""
        raise NotImplementedError

    def eval_examples(self) -> Iterator[Example]:
        """Held-out examples for evals. By default the stream of EVAL_SEED; override it when the task has
        a real held-out split (generated tasks may repeat an example across seeds)."""
        return self.examples(EVAL_SEED)

    async def respond(self, messages: Messages, state: State, example: Example) -> Messages | None:
        """The environment's answer to the assistant's last message (`messages[-1]`), or None when the
        episode is over. `state` starts empty for each episode; keep in it what later turns and reward
        functions need. An override may take a fourth parameter `turn`: the number of assistant answers so
        far (1 after the first)."""
        return None

    async def score(
        self, completion: str, example: Example, state: State, messages: Messages, turns: int, is_truncated: bool
    ) -> Score:
        """The rubric's score of a finished episode."""
        return await self.rubric.score(completion, example, state, messages, turns, is_truncated)

    def deadline(self) -> float | None:
        """When an episode started now must end (time.monotonic), or None without a time limit."""
        return None if self.limits.time_limit is None else time.monotonic() + self.limits.time_limit

    async def rollout_group(self, example: Example, policy: Policy, group_size: int) -> list[Rollout]:
        """Play `group_size` episodes of one example in tokens and score each. The first turn is one request
        for `group_size` samples (the prompt is prefilled once); later turns go on independently, until one
        episode raises: the others are cancelled and the error is the group's."""
        deadline = self.deadline()
        budget = min((b for b in (self.limits.max_tokens, policy.seq_len) if b is not None), default=None)
        start = await asyncio.to_thread(Episode, policy, example.prompt, self.tools, budget, deadline)
        episodes = await start.first_answers(group_size)
        if not episodes:  # no room left for a first answer (time limit or token budget)
            return [await self.finish(start.copy(), example, {}, truncated=True) for _ in range(group_size)]
        return await all_or_none(self.play(e, example, deadline) for e in episodes)

    async def play(self, conversation: Conversation, example: Example, deadline: float | None) -> Rollout:
        """The episode loop, from the first answer on: `respond`, then the next answer, until `respond`
        returns None or a limit (turns, tokens, time) is reached; then score it."""
        state: State = {}
        takes_turn = "turn" in inspect.signature(self.respond).parameters
        while True:
            turn = {"turn": conversation.turns} if takes_turn else {}
            try:
                reply = await asyncio.wait_for(
                    self.respond(conversation.messages, state, example, **turn), remaining_time(deadline)
                )
            except TimeoutError:
                return await self.finish(conversation, example, state, truncated=True)
            except AsyncRLError:
                raise  # the run's own failures (an unreachable env-server) stop the run with one line
            except Exception as e:  # noqa: BLE001 - a failing environment marks the rollout, never the run
                return await self.finish(conversation, example, state, error=f"respond {type(e).__name__}: {e}")
            if reply is None:
                return await self.finish(conversation, example, state, truncated=conversation.finish_reason == "length")
            if conversation.turns >= self.limits.max_turns or not await asyncio.to_thread(
                conversation.add_environment, copy.deepcopy(reply)
            ):
                return await self.finish(conversation, example, state, truncated=True)
            if not await conversation.next_answer():
                return await self.finish(conversation, example, state, truncated=True)

    async def finish(
        self,
        conversation: Conversation,
        example: Example,
        state: State,
        truncated: bool = False,
        error: str | None = None,
    ) -> Rollout:
        answers = [m for m in conversation.messages[len(example.prompt) :] if m["role"] == "assistant"]
        text = (answers[-1].get("content") or "") if answers else ""
        score, score_seconds = None, 0.0
        if error is None:
            start = time.perf_counter()
            score = await self.score(text, example, state, conversation.messages, conversation.turns, truncated)
            score_seconds = time.perf_counter() - start
        return Rollout(
            example=example,
            samples=conversation.samples,
            messages=conversation.messages,
            policy_versions=conversation.policy_versions,
            completion_text=text,
            finish_reason=conversation.finish_reason,
            turns=conversation.turns,
            is_truncated=truncated,
            state=state,
            reward=score.reward if score else 0.0,
            metrics=score.metrics if score else {},
            error=score.error if score else error,
            score_seconds=score_seconds,
            prompt_tokens=conversation.prompt_tokens,
            cached_tokens=conversation.cached_tokens,
        )
