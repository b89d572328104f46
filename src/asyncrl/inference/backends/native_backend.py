"""The native engine (`engine/engine.py`) behind the HTTP routes. The engine decodes on a thread of its own; here its
`concurrent.futures.Future`s become awaitables of the event loop, so no route ever blocks the loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from asyncrl.errors import AsyncRLError
from asyncrl.inference.api.api_errors import APIError
from asyncrl.inference.api.prometheus import prometheus_text
from asyncrl.inference.backends.backend import WEIGHT_UPDATE_TIMEOUT, Backend
from asyncrl.inference.engine.engine import Engine, EngineStats
from asyncrl.inference.engine.sequence import Completion, GenerationRequest, TokenCallback
from asyncrl.transport.transfer import FolderSource
from asyncrl.transport.waiting import PeerTimeout


class NativeBackend(Backend):
    name = "native"

    def __init__(self, engine: Engine, weights: FolderSource | None = None):
        self.engine = engine
        self.weights = weights or FolderSource()  # where an update's weights come from (transport/transfer.py)
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.vocab_size
        self.summary = f"{engine.device}, {engine.cfg.model.dtype}"

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def paused(self) -> bool:
        return self.engine.stats().paused

    async def generate(self, request: GenerationRequest, on_token: TokenCallback | None = None) -> list[Completion]:
        return await wait_for_engine(self.engine.generate(request, on_token))

    async def pause(self) -> None:
        await wait_for_engine(self.engine.pause())

    async def resume(self) -> None:
        await wait_for_engine(self.engine.resume())

    async def update_weights(self, path: str | None, version: int) -> int:
        try:
            source, version = await asyncio.to_thread(self.weights.weights, path, version, WEIGHT_UPDATE_TIMEOUT)
        except PeerTimeout as error:
            raise APIError(504, str(error)) from None
        except AsyncRLError as error:
            raise APIError(400, str(error), "path") from None
        try:
            return await wait_for_engine(self.engine.update_weights(source, version), WEIGHT_UPDATE_TIMEOUT)
        except TimeoutError:
            origin = path or "the weight broadcast"
            raise APIError(504, f"weights from '{origin}' not live after {WEIGHT_UPDATE_TIMEOUT:.0f}s") from None

    async def metrics(self) -> str:
        return engine_metrics(self.engine.stats())

    async def check_ready(self) -> None:
        pass

    def close(self) -> None:
        self.weights.stop()
        self.engine.stop()


async def wait_for_engine(future: concurrent.futures.Future, timeout: float | None = None) -> Any:
    """Await a future the decoding thread resolves. If this call is cancelled, the engine work is too."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def relay(done: concurrent.futures.Future) -> None:  # runs in the decoding thread
        loop.call_soon_threadsafe(_copy_outcome, done, waiter)

    future.add_done_callback(relay)
    try:
        return await asyncio.wait_for(waiter, timeout)
    except asyncio.CancelledError:
        future.cancel()
        raise


def _copy_outcome(done: concurrent.futures.Future, waiter: asyncio.Future) -> None:
    if waiter.done():
        return
    if done.cancelled():
        waiter.cancel()
    elif done.exception() is not None:
        waiter.set_exception(done.exception())
    else:
        waiter.set_result(done.result())


def engine_metrics(stats: EngineStats) -> str:
    usage = stats.kv_cache_used_tokens / stats.kv_cache_total_tokens if stats.kv_cache_total_tokens else 0.0
    return prometheus_text(
        [
            ("running_requests", "gauge", "Requests with a sample in the decoding batch.", stats.running_requests),
            ("waiting_requests", "gauge", "Requests waiting to start.", stats.waiting_requests),
            ("running_sequences", "gauge", "Sequences (samples) in the decoding batch.", stats.running_sequences),
            ("waiting_sequences", "gauge", "Sequences (samples) waiting to start.", stats.waiting_sequences),
            ("kv_cache_used_tokens", "gauge", "KV-cache slots holding tokens.", stats.kv_cache_used_tokens),
            ("kv_cache_total_tokens", "gauge", "KV-cache slots in all.", stats.kv_cache_total_tokens),
            ("kv_cache_usage", "gauge", "Fraction of KV-cache slots in use.", usage),
            (
                "kv_cache_blocks_used",
                "gauge",
                "KV-cache blocks held by running sequences, a shared one once (paged layout; 0 with slots).",
                stats.kv_cache_blocks_used,
            ),
            (
                "kv_cache_blocks_total",
                "gauge",
                "KV-cache blocks in the pool (paged layout; 0 with slots).",
                stats.kv_cache_blocks_total,
            ),
            (
                "preemptions_total",
                "counter",
                "Sequences preempted since start: blocks ran out, they are recomputed (paged layout).",
                stats.preemptions,
            ),
            (
                "prefix_cache_hit_tokens_total",
                "counter",
                "Prefill positions read from the prefix cache instead of computed, since start (paged layout).",
                stats.prefix_cache_hit_tokens,
            ),
            (
                "prefix_cache_blocks_cached",
                "gauge",
                "KV-cache blocks the prefix cache keeps that no running sequence holds (reusable; counted free).",
                stats.prefix_cache_blocks_cached,
            ),
            ("prompt_tokens_total", "counter", "Prompt tokens prefilled since start.", stats.prompt_tokens),
            (
                "generated_tokens_total",
                "counter",
                "Tokens sampled since start (rate() = tokens/s).",
                stats.generated_tokens,
            ),
            ("policy_version", "gauge", "Policy version of the live weights (0 = base model).", stats.policy_version),
            ("paused", "gauge", "1 while decoding is paused by /admin/pause.", int(stats.paused)),
        ]
    )
