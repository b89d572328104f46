"""What one request may ask of the server, whichever backend serves it: the size of its body, its number of
samples, its stop strings. Without these a single request could hold the event loop, or the decoding thread,
for every other client (a 20 MB body took the server for 87 s; 100,000 stop strings slowed every request 12x).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from asyncrl.config.schema import InferenceConfig
from asyncrl.inference.api.api_errors import APIError, error_response
from asyncrl.inference.engine.sequence import GenerationRequest, check_request


class BodySizeLimit:
    """ASGI middleware: a body over `max_bytes` is answered 413 before it is read whole, whether it declares its
    length or comes in chunks."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await error_response(413, self._message())(scope, receive, send)
        received = 0

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                # Raised while the route reads its body: the app's error handlers answer it.
                raise APIError(413, self._message())
            return message

        await self.app(scope, counting_receive, send)

    def _message(self) -> str:
        return (
            f"the request body is larger than the server's limit of {self.max_bytes} bytes "
            "(send less, or raise inference.max_request_bytes)"
        )


LARGE_BODY_BYTES = 65536  # the server's read-ahead per connection before it pauses reading (uvicorn's high water)
BODIES_READ_AT_ONCE = 8


class LargeBodyQueue:
    """ASGI middleware: at most BODIES_READ_AT_ONCE bodies over LARGE_BODY_BYTES (or of undeclared length) are
    read at a time, the others waiting their turn, their connections paused by the server's flow control after
    its first 64 KiB. Read all at once, 200 bodies of 2 MB each made every turn of the event loop run ~130
    socket reads (50-80 ms of CPU), and /health, which needs a few turns, waited 230-300 ms
    (benchmarks/hostile_load.py). Requests without a large body never wait."""

    def __init__(self, app: Any, at_once: int = BODIES_READ_AT_ONCE):
        self.app = app
        self.turns = asyncio.Semaphore(at_once)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not _large_body(scope):
            return await self.app(scope, receive, send)
        state = "waiting"  # -> reading -> read

        async def receive_in_turn() -> dict:
            nonlocal state
            if state == "waiting":
                await self.turns.acquire()
                state = "reading"
            message = await receive()
            if state == "reading" and (message["type"] != "http.request" or not message.get("more_body", False)):
                state = "read"
                self.turns.release()
            return message

        try:
            await self.app(scope, receive_in_turn, send)
        finally:
            if state == "reading":
                self.turns.release()


def _large_body(scope: dict) -> bool:
    headers = dict(scope["headers"])
    declared = headers.get(b"content-length")
    if declared is not None:
        return not declared.isdigit() or int(declared) > LARGE_BODY_BYTES
    return b"chunked" in headers.get(b"transfer-encoding", b"").lower()


class PromptTextLimit:
    """Refuses, before tokenizing it, a prompt text that cannot fit in `seq_len` tokens. No token spells more
    than `longest` characters (the longest entry of the vocabulary: byte-level BPE spells each byte with one
    character, so a token's text is never longer than its entry), so a text of more than seq_len x longest
    characters needs more than seq_len tokens. Tokenizing a 2 MB body only to find it too long took 9-16 s
    of a tokenizer thread, which a departed client cannot cancel."""

    def __init__(self, tokenizer: Any, seq_len: int):
        vocabulary = tokenizer.get_vocab()
        self.longest = max((len(entry) for entry in vocabulary), default=1)
        self.seq_len = seq_len

    def check(self, text: str, field: str) -> None:
        if len(text) > self.seq_len * self.longest:
            raise APIError(
                400,
                f"the prompt's {len(text):,} characters cannot fit in the server's seq_len ({self.seq_len} tokens "
                f"of at most {self.longest} characters each) (shorten the prompt or raise inference.seq_len)",
                field,
            )


def admit(cfg: InferenceConfig, vocab_size: int, requests: Sequence[GenerationRequest]) -> None:
    """Refuse with a 400 the requests (the prompts of one HTTP request) that break the server's limits, or that
    the engine could not serve (`check_request`); the message names the key or the field to change."""
    samples = sum(request.n for request in requests)
    if samples > cfg.max_n:
        raise APIError(
            400, f"{samples} samples asked (n x prompts); this server allows {cfg.max_n} (inference.max_n)", "n"
        )
    stop = requests[0].stop if requests else ()
    if len(stop) > cfg.max_stop_strings:
        raise APIError(
            400,
            f"{len(stop)} stop strings; this server allows {cfg.max_stop_strings} (inference.max_stop_strings)",
            "stop",
        )
    longest = max((len(s) for s in stop), default=0)
    if longest > cfg.max_stop_string_length:
        raise APIError(
            400,
            f"a stop string of {longest} characters; this server allows {cfg.max_stop_string_length} "
            "(inference.max_stop_string_length)",
            "stop",
        )
    for request in requests:
        check_request(request, cfg.seq_len, vocab_size)
