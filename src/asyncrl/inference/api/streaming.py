"""Server-sent events, as OpenAI streams them: the tokens of requests in flight become text deltas on the event
loop as they are sampled."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from asyncrl.inference.api.api_errors import error_body
from asyncrl.inference.api.protocol import prompt_cached_tokens, usage
from asyncrl.inference.api.text import SampleText
from asyncrl.inference.backends.backend import Backend
from asyncrl.inference.engine.sequence import GenerationRequest


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


@dataclass
class StreamPiece:
    """New text of one choice, the tokens it covers (`sample.token_ids[start:end]`), and, on the last piece,
    the finish reason."""

    choice: int
    sample: SampleText
    text: str
    start: int
    end: int
    finish_reason: str | None


class TokenStream:
    """Requests generating on a backend, whose tokens arrive on the event loop as they are sampled. The routes
    check the requests first, so a request the backend refuses is a plain 400 before any event is sent."""

    def __init__(self, backend: Backend, requests: list[GenerationRequest], tokenizer: Any):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.samples: list[SampleText] = []
        self.tasks: list[asyncio.Task] = []
        for request in requests:
            first = len(self.samples)
            self.samples += [SampleText(tokenizer, request.stop) for _ in range(request.n)]
            task = asyncio.ensure_future(backend.generate(request, functools.partial(self._on_token, first)))
            task.add_done_callback(self._queue.put_nowait)
            self.tasks.append(task)

    def _on_token(self, first: int, index: int, token_id: int, logprob: float, top, version: int, finish) -> None:
        # Called on the engine's decoding thread (native) or on the event loop (vLLM).
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (first + index, token_id, logprob, top, finish))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def pieces(self) -> AsyncIterator[StreamPiece]:
        unresolved = len(self.tasks)
        while unresolved:
            item = await self._queue.get()
            if isinstance(item, asyncio.Task):  # a request is done; its last token came before
                unresolved -= 1
                if not item.cancelled() and item.exception() is not None:
                    raise item.exception()
                continue
            choice, token_id, logprob, top, finish_reason = item
            sample = self.samples[choice]
            start = sample.sent_tokens
            text = sample.add(token_id, logprob, top, finish_reason)
            if text or sample.sent_tokens > start or finish_reason is not None:
                yield StreamPiece(choice, sample, text, start, sample.sent_tokens, finish_reason)

    def completion_tokens(self) -> int:
        return sum(len(sample.token_ids) for sample in self.samples)

    def cached_tokens(self) -> int:
        """Prompt tokens read from the prefix cache, each request's prompt once; asked once every request is done."""
        return sum(prompt_cached_tokens(task.result()) for task in self.tasks if not task.cancelled())

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


def usage_chunk(stream_id: str, obj: str, model_name: str, prompt_tokens: int, stream: TokenStream) -> dict:
    """The last event of a stream asked for `stream_options.include_usage`."""
    usage_now = usage(prompt_tokens, stream.completion_tokens(), stream.cached_tokens())
    return {
        "id": stream_id,
        "object": obj,
        "created": int(time.time()),
        "model": model_name,
        "choices": [],
        "usage": usage_now,
    }


def event_stream(
    stream: TokenStream, chunk: Callable[[StreamPiece], dict | None], final: Callable[[], dict | None]
) -> StreamingResponse:
    """The SSE response of a TokenStream: one event per piece (a piece whose `chunk` is None has nothing to
    say yet: its text is held back), the usage event if asked, then [DONE]. A failure
    mid-stream becomes an error event, which the openai client raises as APIError. Starlette ends the stream
    when the client disconnects, and the `finally` then cancels the requests."""

    async def events() -> AsyncIterator[str]:
        try:
            async for piece in stream.pieces():
                event = chunk(piece)
                if event is not None:
                    yield sse(event)
            last = final()
            if last is not None:
                yield sse(last)
        except Exception as error:  # noqa: BLE001 - the status line is sent; the error goes in the stream
            yield sse(error_body(500, str(error)))
        finally:
            stream.cancel()  # the client went away, or the stream ended: no engine work is left behind
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")
