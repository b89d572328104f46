"""The two ways an eval plays an environment's episodes against a served model.

- `TokenRoute`: `/v1/generate`, exactly the rollout training runs (`Environment.rollout_group`, token-in/
  token-out). Needs the model's tokenizer locally; `asyncrl inference` serves this route.
- `ChatRoute`: `/v1/chat/completions`, for any OpenAI-compatible server (vLLM, hosted APIs). The server
  applies its chat template; the environment's episode loop (`Environment.play`) runs over a conversation
  kept in messages (`ChatConversation`) instead of tokens.
"""

from __future__ import annotations

import asyncio
import copy
import os
from typing import Any

import httpx

from asyncrl.config.schema import SamplingConfig
from asyncrl.environments.base import Environment, Example, Messages, Policy, Rollout, remaining_time
from asyncrl.errors import AsyncRLError
from asyncrl.evals.metrics import EvalSample, passes


def eval_sample(label: str, index: int, sample: int, rollout: Rollout, threshold: float) -> EvalSample:
    """One rollout as a line of results.jsonl; token counts and policy versions exist over the token route only."""
    example = rollout.example
    return EvalSample(
        env=label,
        example=index,
        sample=sample,
        prompt=example.prompt[-1]["content"] if example.prompt else "",
        answer=example.answer,
        completion=rollout.completion_text,
        reward=rollout.reward,
        passed=passes(rollout.reward, rollout.error, threshold),
        metrics=rollout.metrics,
        error=rollout.error,
        finish_reason=rollout.finish_reason,
        turns=rollout.turns,
        is_truncated=rollout.is_truncated,
        completion_tokens=rollout.num_completion_tokens if rollout.samples else None,
        policy_version=rollout.min_policy_version if rollout.policy_versions else None,
        messages=rollout.messages,
    )


class TokenRoute:
    """Episodes over `/v1/generate`, played by the environment's own rollout code."""

    def __init__(self, policy: Policy):
        self.policy = policy

    async def play(
        self, env: Environment, label: str, index: int, example: Example, n: int, threshold: float
    ) -> list[EvalSample]:
        rollouts: list[Rollout] = await env.rollout_group(example, self.policy, n)
        return [eval_sample(label, index, j, rollout, threshold) for j, rollout in enumerate(rollouts)]


class RequestRefused(AsyncRLError):
    """The server answered 400: the request itself is at fault (on a later turn: the conversation has
    outgrown the model's context)."""


class OpenAIServer:
    """An OpenAI-compatible server as evals see it. Sends `OPENAI_API_KEY`, when set, as the bearer token."""

    def __init__(self, url: str, model: str, request_timeout: float):
        self.url = url.rstrip("/")
        self.model = model
        key = os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.AsyncClient(base_url=self.url, timeout=request_timeout, headers=headers)

    async def close(self) -> None:
        await self.http.aclose()

    async def wait_ready(self, timeout: float) -> int | None:
        """Wait until `GET /v1/models` answers: the one route every OpenAI-compatible server has. Returns the
        served model's `max_model_len` (vLLM's field for its prompt + completion bound) when it gives one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        status = None
        while loop.time() < deadline:
            try:
                response = await self.http.get("/v1/models", timeout=5)
                status = response.status_code
                if status == 200:
                    cards = response.json().get("data") or [{}]
                    card = next((c for c in cards if c.get("id") == self.model), cards[0])
                    return card.get("max_model_len")
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
        answer = f"answered {status}" if status else "did not answer"
        raise AsyncRLError(f"server at {self.url} {answer} on /v1/models for {timeout:.0f}s (set inference_url)")

    async def has_generate_route(self) -> bool:
        """Whether the server has our token route: an empty body there is a validation error, not a 404."""
        try:
            response = await self.http.post("/v1/generate", json={}, timeout=10)
        except httpx.TransportError:
            return False
        return response.status_code in (400, 422)

    async def chat(
        self, messages: list[dict[str, Any]], n: int, sampling: SamplingConfig, tools: list[dict] | None
    ) -> list[tuple[str, str]]:
        """`n` sampled answers to `messages`: (text, finish reason) each."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "n": n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
        }
        if tools:
            # The environment reads calls from the text itself: "none" has the server render the tools and
            # return the text as written, where "auto" would move the calls out of it.
            body["tools"] = tools
            body["tool_choice"] = "none"
        try:
            response = await self.http.post("/v1/chat/completions", json=body)
        except httpx.TimeoutException:
            raise AsyncRLError(f"server at {self.url} did not answer /v1/chat/completions in time") from None
        except httpx.TransportError as e:
            raise AsyncRLError(f"server at {self.url} is not reachable ({e}); did it stop?") from None
        if response.status_code != 200:
            error = RequestRefused if response.status_code == 400 else AsyncRLError
            raise error(f"server /v1/chat/completions failed ({response.status_code}): {response.text[:500]}")
        choices = response.json()["choices"]
        if len(choices) != n:
            raise AsyncRLError(f"server returned {len(choices)} choices for n = {n} (does it support n?)")
        return [(c["message"].get("content") or "", c.get("finish_reason") or "") for c in choices]


class ChatConversation:
    """One episode over `/v1/chat/completions`, in messages: the `Conversation` the episode loop plays when
    the server applies its own chat template. No tokens come back, so the rollout has no token samples."""

    def __init__(self, route: ChatRoute, env: Environment, messages: Messages, deadline: float | None):
        self.route = route
        self.tools = env.tools
        self.deadline = deadline
        self.messages = messages
        self.turns = 0
        self.finish_reason = ""
        self.samples: list = []
        self.policy_versions: list[int] = []
        self.prompt_tokens = 0  # the server's prompt tokens are not counted at message level
        self.cached_tokens = 0

    def add_answer(self, text: str, finish_reason: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.turns += 1
        self.finish_reason = finish_reason

    def add_environment(self, new_messages: Messages) -> bool:
        self.messages += new_messages  # the server bounds the context: a refused request ends the episode
        return True

    async def next_answer(self) -> bool:
        remaining = remaining_time(self.deadline)
        if remaining is not None and remaining <= 0:
            return False
        try:
            [(text, finish)] = await asyncio.wait_for(
                self.route.server.chat(self.messages, 1, self.route.sampling, self.tools), remaining
            )
        except (TimeoutError, RequestRefused):  # the time limit, or a conversation longer than the context
            return False
        self.add_answer(text, finish)
        return True


class ChatRoute:
    """Episodes over `/v1/chat/completions`: the environment's episode loop (`Environment.play`) in messages."""

    def __init__(self, server: OpenAIServer, sampling: SamplingConfig):
        self.server = server
        self.sampling = sampling

    async def play(
        self, env: Environment, label: str, index: int, example: Example, n: int, threshold: float
    ) -> list[EvalSample]:
        if type(env).rollout_group is not Environment.rollout_group:
            raise AsyncRLError(
                f"environment '{label}' plays its own episodes (it overrides rollout_group): evaluate it over the "
                "token route (api = 'generate', against asyncrl inference)"
            )
        deadline = env.deadline()
        first = await self.server.chat(example.prompt, n, self.sampling, env.tools)
        conversations = [ChatConversation(self, env, copy.deepcopy(example.prompt), deadline) for _ in first]
        for conversation, (text, finish) in zip(conversations, first):
            conversation.add_answer(text, finish)
        rollouts = await asyncio.gather(*(env.play(c, example, deadline) for c in conversations))
        return [eval_sample(label, index, j, rollout, threshold) for j, rollout in enumerate(rollouts)]
