"""The two ways an eval plays an environment's episodes against a served model.

- `TokenRoute`: `/v1/generate`, exactly the rollout training runs (`Environment.rollout_group`, token-in/
  token-out). Needs the model's tokenizer locally; `asyncrl inference` serves this route.
- `ChatRoute`: `/v1/chat/completions`, for any OpenAI-compatible server (vLLM, hosted APIs). The server
  applies its chat template; the episode is the same loop in messages: the model answers, the
  environment's `respond` answers back, until it returns None or `max_turns` is reached.
"""

from __future__ import annotations

import asyncio
import copy
import os
from typing import Any

import httpx

from asyncrl.config.schema import SamplingConfig
from asyncrl.environments.base import Environment, Example, Rollout
from asyncrl.errors import AsyncRLError
from asyncrl.evals.metrics import EvalSample, passes
from asyncrl.orchestrator.client import ServedPolicy


def _sample(label: str, index: int, example: Example, threshold: float, **fields: Any) -> EvalSample:
    passed = passes(fields["reward"], fields["error"], threshold)
    prompt = example.prompt[-1]["content"] if example.prompt else ""
    return EvalSample(env=label, example=index, prompt=prompt, answer=example.answer, passed=passed, **fields)


class TokenRoute:
    """Episodes over `/v1/generate`, played by the environment's own rollout code."""

    def __init__(self, policy: ServedPolicy):
        self.policy = policy

    async def play(
        self, env: Environment, label: str, index: int, example: Example, n: int, threshold: float
    ) -> list[EvalSample]:
        rollouts: list[Rollout] = await env.rollout_group(example, self.policy, n)
        return [
            _sample(
                label,
                index,
                example,
                threshold,
                sample=j,
                completion=r.completion_text,
                reward=r.reward,
                metrics=r.metrics,
                error=r.error,
                finish_reason=r.finish_reason,
                turns=r.turns,
                is_truncated=r.is_truncated,
                completion_tokens=r.num_completion_tokens,
                policy_version=r.min_policy_version if r.policy_versions else None,
            )
            for j, r in enumerate(rollouts)
        ]


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
            body["tools"] = tools
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


class ChatRoute:
    """Episodes over `/v1/chat/completions`: the environment's turn loop in messages."""

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
        first = await self.server.chat(example.prompt, n, self.sampling, env.tools)
        episodes = [self._episode(env, example, text, finish) for text, finish in first]
        return [
            _sample(label, index, example, threshold, sample=j, **fields)
            for j, fields in enumerate(await asyncio.gather(*episodes))
        ]

    async def _episode(self, env: Environment, example: Example, text: str, finish: str) -> dict[str, Any]:
        messages = [*copy.deepcopy(example.prompt), {"role": "assistant", "content": text}]
        state: dict[str, Any] = {}
        turns, truncated, error = 1, False, None
        try:
            async with asyncio.timeout(env.limits.time_limit):
                while True:
                    reply = await env.respond(messages, state, example)
                    if reply is None or turns >= env.limits.max_turns:
                        truncated = reply is not None or finish == "length"
                        break
                    reply = copy.deepcopy(reply)
                    [(text, finish)] = await self.server.chat([*messages, *reply], 1, self.sampling, env.tools)
                    messages += [*reply, {"role": "assistant", "content": text}]
                    turns += 1
        except (TimeoutError, RequestRefused):  # the time limit, or a conversation longer than the context
            truncated = True
        except AsyncRLError:
            raise
        except Exception as e:  # noqa: BLE001 - a failing environment marks the rollout, never the eval
            error = f"respond {type(e).__name__}: {e}"
        reward, metrics = 0.0, {}  # `text`: the last assistant message, as over the token route
        if error is None:
            score = await env.rubric.score(text, example, state)
            reward, metrics, error = score.reward, score.metrics, score.error
        return {
            "completion": text,
            "reward": reward,
            "metrics": metrics,
            "error": error,
            "finish_reason": finish,
            "turns": turns,
            "is_truncated": truncated,
            "completion_tokens": None,
            "policy_version": None,
        }
