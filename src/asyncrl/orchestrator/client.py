"""The orchestrator's side of the inference API: token-in/token-out generation and weight updates.

A connection that breaks before the answer is retried within the call's timeout, since every call here may
safely be sent twice: a generate request carries its seed (the same tokens come back; a server drops the
work of a request whose client went away), a weight update names its version (loading it again changes
nothing), a health check reads. The classic case is a pooled keep-alive connection that the server closes
just as a request goes out on it: the request fails with an empty `RemoteProtocolError` although the server
is fine. Pooled connections are therefore dropped well before uvicorn closes idle ones (5 s), and the one
race left is retried. A connection that cannot be opened at all is not retried: nothing listens there.
Either way a server that cannot be reached raises `ServerUnavailable`, which names it, the route and the
cause, so that a pool can send its work elsewhere.

Every failed call is classified here, and only here, by whose fault it is (`reason`):
- `client_error` (`RequestRejected`): an HTTP 4xx, the request's own fault (a prompt too long, a bad
  schema). Sending it again, anywhere, fails again.
- `server_error`, `connection` (`ServerUnavailable`): an HTTP 5xx, or a connection refused or broken. The
  same request may succeed on another server, or on this one a little later.
- `timeout` (`ServerUnavailable`): no answer within the call's timeout. A slow server is not a dead one:
  the pool charges it no failure and leaves the verdict to its health checks.
"""

from __future__ import annotations

import asyncio
import copy
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from asyncrl.config.schema import SamplingConfig
from asyncrl.environments.base import Completion
from asyncrl.errors import AsyncRLError
from asyncrl.transport import routing

KEEPALIVE_EXPIRY = 2.0  # seconds a pooled connection may idle; uvicorn closes idle ones after 5
RETRY_DELAYS = (0.05, 0.2, 0.5, 1.0, 2.0)  # seconds before each retry of a call whose connection failed


CLIENT_ERROR, SERVER_ERROR, CONNECTION, TIMEOUT = "client_error", "server_error", "connection", "timeout"


class RequestFailed(AsyncRLError):
    """A call that got no usable answer; `reason` says whose fault it is (see the module docstring)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class RequestRejected(RequestFailed):
    """The server refused the request itself (HTTP 4xx): the same request fails on every server."""

    def __init__(self, message: str):
        super().__init__(message, CLIENT_ERROR)


class ServerUnavailable(RequestFailed):
    """The server failed (HTTP 5xx), could not be reached, or did not answer in time: the work can go elsewhere."""

    def __init__(self, message: str, reason: str = CONNECTION):
        super().__init__(message, reason)


class InferenceClient:
    def __init__(self, url: str, admin_token: str | None, request_timeout: float, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.admin_token = admin_token or os.environ.get("ASYNCRL_ADMIN_TOKEN")
        self.api_key = api_key or os.environ.get("ASYNCRL_API_KEY")
        self.request_timeout = request_timeout
        self.http = httpx.AsyncClient(
            base_url=self.url, timeout=request_timeout, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY)
        )

    async def close(self) -> None:
        await self.http.aclose()

    def _headers(self, admin: bool) -> dict[str, str]:
        token = self.admin_token if admin else self.api_key
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def _request(
        self, method: str, route: str, body: dict | None = None, admin: bool = False, timeout: float | None = None
    ) -> httpx.Response:
        """Send once, and again after a connection failure, until `timeout` (the client's) has passed."""
        timeout = self.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for attempt in range(len(RETRY_DELAYS) + 1):
            left = deadline - time.monotonic()
            try:
                return await self.http.request(
                    method, route, json=body, headers=self._headers(admin), timeout=max(left, 0.1)
                )
            except httpx.TimeoutException:
                raise ServerUnavailable(
                    f"inference server at {self.url} did not answer {route} within {timeout:.0f}s", TIMEOUT
                ) from None
            except httpx.TransportError as error:
                reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
                refused = isinstance(error, httpx.ConnectError)
                if refused or attempt == len(RETRY_DELAYS) or deadline - time.monotonic() <= RETRY_DELAYS[attempt]:
                    raise ServerUnavailable(
                        f"inference server at {self.url} is not reachable on {route} ({reason}) "
                        f"after {attempt + 1} attempt(s); did it stop?"
                    ) from None
                await asyncio.sleep(RETRY_DELAYS[attempt])
        raise AssertionError("unreachable")

    async def _post(self, route: str, body: dict[str, Any], admin: bool = False) -> dict[str, Any]:
        response = await self._request("POST", route, body, admin)
        if response.status_code == 200:
            return response.json()
        message = f"inference server at {self.url}: {route} failed ({response.status_code}): {response.text[:500]}"
        if 400 <= response.status_code < 500:
            raise RequestRejected(message)
        raise ServerUnavailable(message, SERVER_ERROR)

    async def health(self, timeout: float) -> dict[str, Any]:
        """The server's /health answer; ServerUnavailable when it does not answer within `timeout`."""
        response = await self._request("GET", "/health", timeout=timeout)
        if response.status_code != 200:
            raise ServerUnavailable(
                f"inference server at {self.url}: /health answered {response.status_code}", SERVER_ERROR
            )
        return response.json()

    async def wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                state = await self.health(timeout=5)
                if state.get("ready"):
                    return state
            except ServerUnavailable:
                pass
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"inference server at {self.url} not ready after {timeout:.0f}s")
            await asyncio.sleep(0.2)

    async def generate(
        self,
        prompt_ids: list[int],
        n: int,
        sampling: SamplingConfig,
        max_tokens: int | None = None,
        seed: int | None = None,
        routed_experts: bool = False,
    ) -> list[Completion]:
        """`n` samples of `prompt_ids`; with `routed_experts`, each with the experts its tokens went to."""
        body = {
            "prompt_ids": prompt_ids,
            "n": n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": max_tokens or sampling.max_tokens,
            "seed": seed,
        }
        if sampling.ignore_eos:
            body["ignore_eos"] = True
        if routed_experts:
            body["return_routed_experts"] = True
        result = await self._post("/v1/generate", body)
        prompt_routed = result.get("prompt_routed_experts")
        prompt_routed = routing.decode(prompt_routed) if prompt_routed is not None else None
        return [
            Completion(
                c["token_ids"],
                c["logprobs"],
                c["policy_versions"],
                c["finish_reason"],
                prompt_routed,
                routing.decode(c["routed_experts"]) if "routed_experts" in c else None,
                c.get("cached_tokens", 0),
            )
            for c in result["choices"]
        ]

    async def update_weights(self, path: Path | None, version: int) -> int:
        """Make `version` live: from its published folder, or (path None) from the weight broadcast, which
        serves the newest version >= `version` it received. Returns the version now live."""
        body = {"version": version} if path is None else {"path": str(path), "version": version}
        result = await self._post("/admin/update_weights", body, admin=True)
        return int(result["policy_version"])


class ServedPolicy:
    """The `Policy` environments talk to: an inference server plus the run's tokenizer and sampling.
    `seq_len` is the server's bound on prompt + completion tokens, which multi-turn rollouts stay within."""

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: Any,
        sampling: SamplingConfig,
        seq_len: int | None = None,
        routed_experts: bool = False,
    ):
        self.client = client
        self.routed_experts = routed_experts  # ask for the experts each token went to (router replay)
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.temperature = sampling.temperature
        self.max_tokens = sampling.max_tokens
        self.seq_len = seq_len
        self.seed: int | None = None  # set on one group's view by `seeded`
        self._asked: Counter[tuple[int, ...]] = Counter()

    def seeded(self, seed: int) -> ServedPolicy:
        """One group's view of this policy: its requests carry seeds derived from `seed` and the prompt, so a
        rerun of the group (a resumed run, or a group sent to another server) samples the same tokens."""
        view = copy.copy(self)
        view.seed, view._asked = seed, Counter()
        return view

    def _request_seed(self, prompt_ids: list[int]) -> int | None:
        if self.seed is None:
            return None
        # From the prompt, not the order of calls: a multi-turn group's episodes ask concurrently.
        key = tuple(prompt_ids)
        self._asked[key] += 1
        return random.Random(hash((self.seed, key, self._asked[key]))).getrandbits(48)

    async def generate(
        self, prompt_ids: list[int], n: int, max_tokens: int | None = None, seed: int | None = None
    ) -> list[Completion]:
        seed = self._request_seed(prompt_ids) if seed is None else seed
        return await self.client.generate(prompt_ids, n, self.sampling, max_tokens, seed, self.routed_experts)
