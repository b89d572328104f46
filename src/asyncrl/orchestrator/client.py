"""The orchestrator's side of the inference API: token-in/token-out generation and weight updates."""

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


class InferenceClient:
    def __init__(self, url: str, admin_token: str | None, request_timeout: float):
        self.url = url.rstrip("/")
        self.admin_token = admin_token or os.environ.get("ASYNCRL_ADMIN_TOKEN")
        self.http = httpx.AsyncClient(base_url=self.url, timeout=request_timeout)

    async def close(self) -> None:
        await self.http.aclose()

    async def _post(self, route: str, body: dict[str, Any], admin: bool = False) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.admin_token}"} if admin and self.admin_token else {}
        try:
            response = await self.http.post(route, json=body, headers=headers)
        except httpx.TimeoutException:
            raise AsyncRLError(f"inference server at {self.url} did not answer {route} in time") from None
        except httpx.TransportError as e:
            raise AsyncRLError(f"inference server at {self.url} is not reachable ({e}); did it stop?") from None
        if response.status_code != 200:
            raise AsyncRLError(f"inference server {route} failed ({response.status_code}): {response.text[:500]}")
        return response.json()

    async def wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                response = await self.http.get("/health", timeout=5)
                if response.status_code == 200 and response.json().get("ready"):
                    return response.json()
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AsyncRLError(f"inference server at {self.url} not ready after {timeout:.0f}s")
            await asyncio.sleep(0.2)

    async def generate(
        self,
        prompt_ids: list[int],
        n: int,
        sampling: SamplingConfig,
        max_tokens: int | None = None,
        seed: int | None = None,
    ) -> list[Completion]:
        body = {
            "prompt_ids": prompt_ids,
            "n": n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": max_tokens or sampling.max_tokens,
            "seed": seed,
        }
        result = await self._post("/v1/generate", body)
        return [
            Completion(c["token_ids"], c["logprobs"], c["policy_versions"], c["finish_reason"])
            for c in result["choices"]
        ]

    async def update_weights(self, path: Path | None, version: int) -> int:
        """Make `version` live: from its published folder, or (path None) from the weight broadcast, which
        serves the newest version >= `version` it received. Returns the version now live."""
        body = {"version": version} if path is None else {"path": str(path), "version": version}
        result = await self._post("/admin/update_weights", body, admin=True)
        return int(result["policy_version"])


class ServedPolicy:
    """The `Policy` environments talk to: the inference server plus the run's tokenizer and sampling.
    `seq_len` is the server's bound on prompt + completion tokens, which multi-turn rollouts stay within."""

    def __init__(self, client: InferenceClient, tokenizer: Any, sampling: SamplingConfig, seq_len: int | None = None):
        self.client = client
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.temperature = sampling.temperature
        self.max_tokens = sampling.max_tokens
        self.seq_len = seq_len
        self.seed: int | None = None  # set on one group's view by `seeded`
        self._asked: Counter[tuple[int, ...]] = Counter()

    def seeded(self, seed: int) -> ServedPolicy:
        """One group's view of this policy: its requests carry seeds derived from `seed` and the prompt, so a
        rerun of the group (a resumed run) samples the same tokens."""
        view = copy.copy(self)
        view.seed, view._asked = seed, Counter()
        return view

    async def generate(
        self, prompt_ids: list[int], n: int, max_tokens: int | None = None, seed: int | None = None
    ) -> list[Completion]:
        if seed is None and self.seed is not None:
            # From the prompt, not the order of calls: a multi-turn group's episodes ask concurrently.
            key = tuple(prompt_ids)
            self._asked[key] += 1
            seed = random.Random(hash((self.seed, key, self._asked[key]))).getrandbits(48)
        return await self.client.generate(prompt_ids, n, self.sampling, max_tokens, seed)
