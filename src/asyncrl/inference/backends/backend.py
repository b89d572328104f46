"""The engine behind the HTTP routes, as the routes see it. One app serves either backend, so a route, a limit or
an auth check is written once: `native_backend.NativeBackend` (our engine, in this process) and
`vllm_backend.VLLMBackend` (a vLLM server, run as a child process) both implement this interface.

A backend takes token-level requests (`GenerationRequest`) and returns token-level completions; the routes do
all the translating (chat templates, text, stop strings, logprob entries, streaming). Errors: `RequestError`
for a request it cannot serve (400), `WeightsError` for weights it refuses (400, the old weights stay), and
`APIError` with its own status for anything else the client should see (an unreachable vLLM: 503).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from asyncrl.inference.engine.sequence import Completion, GenerationRequest, TokenCallback

WEIGHT_UPDATE_TIMEOUT = 600.0  # seconds until /admin/update_weights gives up waiting (the load may still land)


class Backend(ABC):
    name: str  # "native" or "vllm", as /health reports it
    tokenizer: Any  # the served model's Hugging Face tokenizer
    vocab_size: int  # token ids must be below it
    summary: str  # where and how it runs, for the start-up line: "cpu, float32"

    @property
    @abstractmethod
    def policy_version(self) -> int:
        """The version of the weights new tokens are sampled with (0 = the base model)."""

    @property
    @abstractmethod
    def paused(self) -> bool: ...

    @abstractmethod
    async def generate(self, request: GenerationRequest, on_token: TokenCallback | None = None) -> list[Completion]:
        """The request's n completions. Cancelling this call stops its samples, waiting or running. `on_token`,
        when given, sees every token as it is sampled (see TokenCallback), on any thread."""

    @abstractmethod
    async def pause(self) -> None:
        """Returns once no decoding step runs; requests in flight are frozen, new ones queue."""

    @abstractmethod
    async def resume(self) -> None: ...

    @abstractmethod
    async def update_weights(self, path: str | None, version: int) -> int:
        """Make the weights of a published `weights/step_N` folder (or, path None, the newest version >= `version`
        received by broadcast) live between two decoding steps, as `version`; returns the version now live."""

    @abstractmethod
    async def metrics(self) -> str:
        """Prometheus text, every name of ours prefixed `asyncrl_inference_`."""

    @abstractmethod
    async def check_ready(self) -> None:
        """Raises APIError when the backend cannot serve (vLLM gone)."""

    def watch(self, on_failure: Callable[[], None]) -> None:  # noqa: B027 - most backends never stop on their own
        """Call `on_failure` (from any thread) if the backend stops serving on its own; `close` then raises."""

    @abstractmethod
    def close(self) -> None:
        """Stop the backend; raises AsyncRLError naming the failure if it had stopped on its own."""
