"""The HTTP front of the inference engine: FastAPI routes that translate requests, never tensors.

Routes (see docs/inference.md for the JSON):
- `POST /v1/generate`: token ids in, token ids + per-token logprobs + policy versions out (the trainer's path);
- `POST /inference/v1/generate`: the same in vLLM's token-route shape, which verifiers' train client speaks;
- `POST /v1/chat/completions`, `POST /v1/completions` (streaming too), `GET /v1/models`: OpenAI-compatible;
- `GET /health`, `GET /metrics` (Prometheus text);
- `POST /admin/pause`, `/admin/resume`, `/admin/update_weights`: need `Authorization: Bearer <admin token>`.

Handlers are async and never block the event loop: they hand work to the engine's decoding thread and
await its `concurrent.futures.Future` through an asyncio future resolved with `call_soon_threadsafe`.
Streaming gets each token the same way, through the engine's `on_token` hook.

`inference.backend = "vllm"` serves the same routes in front of a vLLM child process (`vllm_backend.py`);
the request bodies, errors, admin check and socket handling below are shared with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import hmac
import itertools
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from asyncrl.config.schema import InferenceConfig
from asyncrl.errors import AsyncRLError
from asyncrl.inference.engine import (
    MAX_TOP_LOGPROBS,
    Completion,
    Engine,
    EngineStats,
    GenerationRequest,
    RequestError,
    WeightsError,
)
from asyncrl.loading import resolve_device
from asyncrl.transport.broadcast import WeightReceiver

log = logging.getLogger("asyncrl.inference")
T = TypeVar("T")

WEIGHT_UPDATE_TIMEOUT = 600.0  # seconds until /admin/update_weights gives up waiting (the load may still land)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of seq_len
TOKEN_ID_PREFIX = "token_id:"  # how vLLM (and verifiers' train client) spell a token id where text is expected


# ---- request bodies ----


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")  # our own route: a misspelled field is an error, not a default

    prompt_ids: list[int] = Field(min_length=1)
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    max_tokens: int = Field(64, ge=1)
    stop_token_ids: list[int] = []
    seed: int | None = None
    ignore_eos: bool = False


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class OpenAIBody(BaseModel):
    # OpenAI clients send fields we do not implement (user, penalties, ...): accepted and ignored.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class ChatBody(OpenAIBody):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionBody(OpenAIBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False


class TokenSamplingParams(BaseModel):
    # vLLM's SamplingParams has many more fields (penalties, detokenize, ...): accepted and ignored.
    model_config = ConfigDict(extra="ignore")

    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # vLLM spells "no limit" -1 or 0
    min_p: float = Field(0.0, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class TokenGenerateBody(BaseModel):
    """vLLM's `/inference/v1/generate` request, the subset a token-level client needs."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: TokenSamplingParams = TokenSamplingParams()
    stream: bool = False


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = None  # None: the newest version >= `version` received by weight broadcast
    version: int = Field(ge=0)


# ---- errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} ----

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    504: "timeout_error",
}


class APIError(HTTPException):
    """An error answer; `param` names the request field at fault, as OpenAI's errors do."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(status, message)
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    error_type = ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Every error, on every route, in OpenAI's shape, so the `openai` client raises the matching class."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        parts, params = [], []
        for item in error.errors():
            where = ".".join(str(p) for p in item["loc"] if p != "body")
            parts.append(f"{where}: {item['msg']}" if where else item["msg"])
            params.append(where)
        return error_response(400, "; ".join(parts), next((p for p in params if p), None))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, error: HTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail), getattr(error, "param", None))

    @app.exception_handler(RequestError)
    async def _bad_request(_: Request, error: RequestError) -> JSONResponse:
        return error_response(400, str(error))

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, error: ClientDisconnected) -> JSONResponse:
        return error_response(499, "the client closed the connection before the answer was ready")

    @app.exception_handler(AsyncRLError)
    async def _failed(_: Request, error: AsyncRLError) -> JSONResponse:
        return error_response(500, str(error))


def admin_guard(cfg: InferenceConfig) -> Callable[[Request], None]:
    """The dependency of the /admin routes: the run's admin token as a bearer token."""
    admin_token = cfg.admin_token or os.environ.get("ASYNCRL_ADMIN_TOKEN") or None

    def require_admin(request: Request) -> None:
        if admin_token is None:
            raise APIError(
                403,
                "admin routes are disabled: set inference.admin_token or the "
                "ASYNCRL_ADMIN_TOKEN environment variable of the server",
            )
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), admin_token.encode()):
            raise APIError(401, "missing or wrong admin token (send 'Authorization: Bearer <token>')")

    return require_admin


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return tuple(s for s in stop if s)


def sse(data: dict | str) -> str:
    """One server-sent event, as OpenAI streams them."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


# ---- bridging the engine thread and the event loop ----


async def wait_for_engine(future: concurrent.futures.Future, timeout: float | None = None) -> Any:
    """Await a future the decoding thread resolves. If this handler is cancelled, the engine work is too."""
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


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client goes away first: a client that times out or disconnects
    (the orchestrator dropping a stale group) must not leave samples decoding to max_tokens for no one.
    The body has been read by now, so the next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        raise ClientDisconnected
    return task.result()


class ClientDisconnected(Exception):
    """The client left before its answer was ready; there is nobody to answer."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _copy_outcome(done: concurrent.futures.Future, waiter: asyncio.Future) -> None:
    if waiter.done():
        return
    if done.cancelled():
        waiter.cancel()
    elif done.exception() is not None:
        waiter.set_exception(done.exception())
    else:
        waiter.set_result(done.result())


# ---- streaming ----


class SampleText:
    """One sample's tokens turned into text deltas as they arrive. A delta never shows part of a stop string
    or half a UTF-8 character, and the deltas add up to the text of the same answer unstreamed."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.sent_tokens = 0  # tokens whose text has been sent
        self.sent_text = ""

    def add(self, token_id: int, logprob: float, top: list[tuple[int, float]], finish_reason: str | None) -> str:
        """Record a token; return the text that became safe to show (may be empty)."""
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.top_logprobs.append(top)
        if finish_reason is not None:
            text, covered = visible_text(self.tokenizer, self.token_ids, finish_reason, self.stop)
        else:
            text, covered = self._settled()
        delta = text[len(self.sent_text) :]
        self.sent_text, self.sent_tokens = text, max(covered, self.sent_tokens)
        return delta

    def _settled(self) -> tuple[str, int]:
        """The longest token prefix whose text is final: no trailing replacement character (a multi-byte
        character cut between tokens) and no tail that a stop string could still start with."""
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        full = decode(self.token_ids)
        held = max((k for s in self.stop for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
        limit = len(full) - held
        count, text = len(self.token_ids), full
        while count > self.sent_tokens and (len(text) > limit or text.endswith("\ufffd")):
            count -= 1
            text = decode(self.token_ids[:count])
        if count <= self.sent_tokens or not text.startswith(self.sent_text):
            return self.sent_text, self.sent_tokens
        return text, count


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
    """Requests queued with the engine whose tokens arrive on the event loop as they are sampled.

    Built in the handler, so a request the engine refuses is a plain 400 before any event is sent."""

    def __init__(self, engine: Engine, requests: list[GenerationRequest], tokenizer: Any):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.samples: list[SampleText] = []
        self.futures: list[concurrent.futures.Future] = []
        try:
            for request in requests:
                first = len(self.samples)
                self.samples += [SampleText(tokenizer, request.stop) for _ in range(request.n)]
                future = engine.generate(request, functools.partial(self._on_token, first))
                future.add_done_callback(self._relay)
                self.futures.append(future)
        except BaseException:
            self.cancel()
            raise

    def _relay(self, item: Any) -> None:  # called from the decoding thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _on_token(self, first: int, index: int, token_id: int, logprob: float, top, version: int, finish) -> None:
        self._relay((first + index, token_id, logprob, top, finish))

    async def pieces(self) -> AsyncIterator[StreamPiece]:
        unresolved = len(self.futures)
        while unresolved:
            item = await self._queue.get()
            if isinstance(item, concurrent.futures.Future):  # a request is done; its last token came before
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

    def cancel(self) -> None:
        for future in self.futures:
            future.cancel()


def event_stream(stream: TokenStream, chunk: Callable[[StreamPiece], dict], usage: Callable[[], dict | None]):
    """The SSE response of a TokenStream: one event per piece, the usage event if asked, then [DONE]. An
    engine failure mid-stream becomes an error event, which the openai client raises as APIError."""

    async def events() -> AsyncIterator[str]:
        try:
            async for piece in stream.pieces():
                yield sse(chunk(piece))
            final = usage()
            if final is not None:
                yield sse(final)
        except Exception as error:  # noqa: BLE001 - the status line is sent; the error goes in the stream
            yield sse(error_body(500, str(error)))
        finally:
            stream.cancel()  # the client went away, or the stream ended: no engine work is left behind
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


# ---- Prometheus text ----


def prometheus_text(values: list[tuple[str, str, str, float]]) -> str:
    lines = []
    for name, kind, help_text, value in values:
        metric = f"asyncrl_inference_{name}"
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}", f"{metric} {value:g}"]
    return "\n".join(lines) + "\n"


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


# ---- the app ----


def create_app(engine: Engine, cfg: InferenceConfig, receiver: WeightReceiver | None = None) -> FastAPI:
    app = FastAPI(title="asyncrl inference", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    tokenizer = engine.tokenizer
    model_name = cfg.model.name
    require_admin = admin_guard(cfg)

    def sampling(body: OpenAIBody | GenerateBody | TokenSamplingParams) -> dict[str, Any]:
        return {
            "n": body.n,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": max(body.top_k, 0),
            "min_p": body.min_p,
            "seed": body.seed,
        }

    async def run(request: GenerationRequest, raw: Request) -> list[Completion]:
        return await unless_disconnected(raw, wait_for_engine(engine.generate(request)))

    # ---- status ----

    @app.get("/health")
    async def health() -> dict:
        stats = engine.stats()
        return {"ready": True, "model": model_name, "policy_version": stats.policy_version, "paused": stats.paused}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine_metrics(engine.stats()), media_type="text/plain; version=0.0.4")

    # ---- tokens in, tokens out ----

    @app.post("/v1/generate")
    async def generate(body: GenerateBody, raw: Request) -> dict:
        request = GenerationRequest(
            prompt_ids=body.prompt_ids,
            max_tokens=body.max_tokens,
            stop_token_ids=tuple(body.stop_token_ids),
            ignore_eos=body.ignore_eos,
            **sampling(body),
        )
        completions = await run(request, raw)
        choices = [
            {
                "token_ids": c.token_ids,
                "logprobs": c.logprobs,
                "policy_versions": c.policy_versions,
                "finish_reason": c.finish_reason,
            }
            for c in completions
        ]
        return {"choices": choices, "prompt_tokens": len(body.prompt_ids)}

    @app.post("/inference/v1/generate")
    async def generate_like_vllm(body: TokenGenerateBody, raw: Request) -> dict:
        if body.stream:
            raise APIError(400, "stream=true is not supported on /inference/v1/generate (send stream=false)", "stream")
        params = body.sampling_params
        request = GenerationRequest(
            prompt_ids=body.token_ids,
            max_tokens=params.max_tokens or max(cfg.seq_len - len(body.token_ids), 1),
            stop_token_ids=tuple(params.stop_token_ids or ()),
            stop=stop_strings(params.stop),
            top_logprobs=params.logprobs or 0,
            **sampling(params),
        )
        completions = await run(request, raw)
        choices = []
        for index, completion in enumerate(completions):
            logprobs = None
            if params.logprobs is not None:
                logprobs = {"content": token_id_logprobs(completion)}
            choices.append(
                {
                    "index": index,
                    "token_ids": completion.token_ids,
                    "logprobs": logprobs,
                    "finish_reason": completion.finish_reason,
                    "policy_versions": completion.policy_versions,
                }
            )
        return {
            "request_id": f"generate-tokens-{uuid.uuid4().hex}",
            "model": model_name,
            "choices": choices,
            "usage": usage(len(body.token_ids), sum(len(c.token_ids) for c in completions)),
        }

    # ---- OpenAI-compatible ----

    def openai_request(
        body: OpenAIBody, prompt_ids: list[int], max_tokens: int, top_logprobs: int
    ) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            stop=stop_strings(body.stop),
            top_logprobs=top_logprobs,
            **sampling(body),
        )

    def usage_event(body: OpenAIBody, obj: str, stream_id: str, prompt_tokens: int, stream: TokenStream):
        def final() -> dict | None:
            if body.stream_options is None or not body.stream_options.include_usage:
                return None
            return {
                "id": stream_id,
                "object": obj,
                "created": int(time.time()),
                "model": model_name,
                "choices": [],
                "usage": usage(prompt_tokens, stream.completion_tokens()),
            }

        return final

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(model_name)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != model_name:
            raise APIError(404, f"model '{model_id}' is not served here (this server serves '{model_name}')", "model")
        return model_card(model_name)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatBody, raw: Request) -> dict | StreamingResponse:
        if tokenizer.chat_template is None:
            raise APIError(400, f"model {model_name} has no chat template (use /v1/completions)", "messages")
        messages = [_flatten_content(message) for message in body.messages]
        try:
            prompt_ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as error:  # noqa: BLE001 - a template error is the request's fault
            raise APIError(400, f"messages do not fit the chat template: {error}", "messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens or max(cfg.seq_len - len(prompt_ids), 1)
        request = openai_request(body, prompt_ids, max_tokens, body.top_logprobs or 0)
        chat_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        if body.stream:
            stream = TokenStream(engine, [request], tokenizer)
            started: set[int] = set()

            def chunk(piece: StreamPiece) -> dict:
                delta: dict[str, Any] = {"content": piece.text}
                if piece.choice not in started:
                    started.add(piece.choice)
                    delta["role"] = "assistant"
                sample = piece.sample
                logprobs = None
                if body.logprobs:
                    span = slice(piece.start, piece.end)
                    content = chat_logprob_entries(
                        tokenizer, sample.token_ids[span], sample.logprobs[span], sample.top_logprobs[span]
                    )
                    logprobs = {"content": content}
                choice = {"index": piece.choice, "delta": delta, "logprobs": logprobs}
                choice["finish_reason"] = piece.finish_reason
                return {
                    "id": chat_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model_name,
                    "choices": [choice],
                }

            final = usage_event(body, "chat.completion.chunk", chat_id, len(prompt_ids), stream)
            return event_stream(stream, chunk, final)

        completions = await run(request, raw)
        choices = []
        for index, completion in enumerate(completions):
            text, covered = visible_text(tokenizer, completion.token_ids, completion.finish_reason, request.stop)
            logprobs = None
            if body.logprobs:
                span = slice(0, covered)
                content = chat_logprob_entries(
                    tokenizer, completion.token_ids[span], completion.logprobs[span], completion.top_logprobs[span]
                )
                logprobs = {"content": content}
            choices.append(
                {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs,
                    "finish_reason": completion.finish_reason,
                }
            )
        return {
            "id": chat_id,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": usage(len(prompt_ids), sum(len(c.token_ids) for c in completions)),
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody, raw: Request) -> dict | StreamingResponse:
        if body.echo:
            raise APIError(400, "echo=true is not supported (send echo=false)", "echo")
        prompts = _prompt_list(body.prompt, tokenizer)
        max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        requests = [openai_request(body, ids, max_tokens, body.logprobs or 0) for ids in prompts]
        completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = sum(len(ids) for ids in prompts)
        with_top = bool(body.logprobs)

        if body.stream:
            stream = TokenStream(engine, requests, tokenizer)

            def chunk(piece: StreamPiece) -> dict:
                sample = piece.sample
                logprobs = None
                if body.logprobs is not None:
                    span = slice(piece.start, piece.end)
                    offset = len(sample.sent_text) - len(piece.text)
                    logprobs = completion_logprobs(
                        tokenizer,
                        sample.token_ids[span],
                        sample.logprobs[span],
                        sample.top_logprobs[span],
                        with_top,
                        offset,
                    )
                choice = {"index": piece.choice, "text": piece.text, "logprobs": logprobs}
                choice["finish_reason"] = piece.finish_reason
                return {
                    "id": completion_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [choice],
                }

            return event_stream(
                stream, chunk, usage_event(body, "text_completion", completion_id, prompt_tokens, stream)
            )

        # Every prompt is queued before any is awaited, so they share decoding batches.
        futures: list[concurrent.futures.Future] = []
        try:
            for request in requests:
                futures.append(engine.generate(request))
        except RequestError:
            for future in futures:
                future.cancel()
            raise
        waiting = asyncio.gather(*(wait_for_engine(future) for future in futures))
        results = await unless_disconnected(raw, waiting)
        choices = []
        for request, completion in ((r, c) for r, result in zip(requests, results) for c in result):
            text, covered = visible_text(tokenizer, completion.token_ids, completion.finish_reason, request.stop)
            logprobs = None
            if body.logprobs is not None:
                span = slice(0, covered)
                logprobs = completion_logprobs(
                    tokenizer,
                    completion.token_ids[span],
                    completion.logprobs[span],
                    completion.top_logprobs[span],
                    with_top,
                )
            choices.append(
                {"index": len(choices), "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason}
            )
        generated = sum(len(c.token_ids) for result in results for c in result)
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": usage(prompt_tokens, generated),
        }

    # ---- admin ----

    @app.post("/admin/pause", dependencies=[Depends(require_admin)])
    async def pause() -> dict:
        await wait_for_engine(engine.pause())
        return {"paused": True, "policy_version": engine.policy_version}

    @app.post("/admin/resume", dependencies=[Depends(require_admin)])
    async def resume() -> dict:
        await wait_for_engine(engine.resume())
        return {"paused": False, "policy_version": engine.policy_version}

    @app.post("/admin/update_weights", dependencies=[Depends(require_admin)])
    async def update_weights(body: UpdateWeightsBody) -> dict:
        source, version = body.path, body.version
        if source is None:
            if receiver is None:
                raise APIError(
                    400,
                    "no path given, and this server receives no weight broadcast (give the path of a published "
                    "weights/step_N folder, or start the server with weight_transfer.mode = 'broadcast')",
                    "path",
                )
            try:
                source, version = await asyncio.to_thread(receiver.take, body.version, WEIGHT_UPDATE_TIMEOUT)
            except AsyncRLError as error:
                raise APIError(504, str(error)) from None
        try:
            version = await wait_for_engine(engine.update_weights(source, version), WEIGHT_UPDATE_TIMEOUT)
        except WeightsError as error:
            raise APIError(400, str(error), "path") from None
        except TimeoutError:
            origin = body.path or "the weight broadcast"
            raise APIError(504, f"weights from '{origin}' not live after {WEIGHT_UPDATE_TIMEOUT:.0f}s") from None
        return {"policy_version": version}

    return app


# ---- OpenAI response pieces ----


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_card(model_name: str) -> dict:
    return {"id": model_name, "object": "model", "created": 0, "owned_by": "asyncrl"}


def visible_text(tokenizer: Any, token_ids: list[int], finish_reason: str, stop: tuple[str, ...]) -> tuple[str, int]:
    """The text OpenAI clients see and how many tokens it covers: cut before the first stop string, and
    without the EOS / stop token that ended the sample (usage still counts every generated token)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stop if s in text]
    if cuts:
        text = text[: min(cuts)]
        # The fewest tokens whose text reaches the cut; decoded lengths grow with the prefix.
        low, high = 0, len(token_ids)
        while low < high:
            middle = (low + high) // 2
            if len(tokenizer.decode(token_ids[:middle], skip_special_tokens=True)) >= len(text):
                high = middle
            else:
                low = middle + 1
        return text, low
    if finish_reason == "stop":
        return text, len(token_ids) - 1
    return text, len(token_ids)


def chat_logprob_entries(
    tokenizer: Any, token_ids: list[int], logprobs: list[float], top_logprobs: list[list[tuple[int, float]]]
) -> list[dict]:
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [
        {**entry(token_id, logprob), "top_logprobs": [entry(*pair) for pair in top]}
        for token_id, logprob, top in zip(token_ids, logprobs, top_logprobs or [[]] * len(token_ids))
    ]


def completion_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    logprobs: list[float],
    top_logprobs: list[list[tuple[int, float]]],
    with_top: bool,
    text_offset: int = 0,
) -> dict:
    tokens = [tokenizer.decode([token_id]) for token_id in token_ids]
    tops = [{tokenizer.decode([i]): lp for i, lp in top} for top in top_logprobs] if with_top else None
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops or [None] * len(tokens),
        "text_offset": list(itertools.accumulate((len(token) for token in tokens), initial=text_offset))[:-1],
    }


def token_id_logprobs(completion: Completion) -> list[dict]:
    """Logprob entries of vLLM's token route: the token is spelled `token_id:N` (verifiers' train client
    checks that) and also given as an int `token_id` (vLLM 0.32's tokens mode)."""

    def entry(token_id: int, logprob: float) -> dict:
        return {"token": f"{TOKEN_ID_PREFIX}{token_id}", "token_id": token_id, "logprob": logprob}

    tops = completion.top_logprobs or [[]] * len(completion.token_ids)
    return [
        {**entry(token_id, logprob), "top_logprobs": [entry(*pair) for pair in top]}
        for token_id, logprob, top in zip(completion.token_ids, completion.logprobs, tops)
    ]


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI lets content be a list of parts; templates of small models expect a string."""
    content = message.get("content")
    if isinstance(content, list):
        text = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return {**message, "content": text}
    if content is None:
        return {**message, "content": ""}
    return message


def _prompt_list(prompt: str | list[int] | list[str] | list[list[int]], tokenizer: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", "prompt")
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


# ---- the process ----


def bind_socket(host: str, port: int) -> socket.socket:
    """Claim the port before the model loads, so that a port in use fails at once with one clear line.
    The socket listens right away: clients that connect while the model loads wait instead of failing."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as error:
        raise AsyncRLError(f"cannot resolve host '{host}': {error.strerror} (set inference.host)") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    # Like uvicorn: lets a restarted server take the port while old connections linger in TIME_WAIT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise AsyncRLError(f"port {port} on {host} is in use (set inference.port)") from None
        raise AsyncRLError(f"cannot listen on {host}:{port}: {error.strerror} (set inference.host)") from None
    return sock


def http_server(app: FastAPI) -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))


def serve(cfg: InferenceConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if cfg.backend == "vllm":
        from asyncrl.inference.vllm_backend import serve_vllm

        return serve_vllm(cfg)
    sock = bind_socket(cfg.host, cfg.port)
    receiver = None
    try:
        if cfg.weight_transfer.mode == "broadcast":  # listening now; the trainer joins when it starts
            receiver = WeightReceiver(cfg.weight_transfer, resolve_device(cfg.device))
        engine = Engine(cfg)
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    log.info(
        "serving %s (policy version 0, %s, %s) on http://%s:%d",
        cfg.model.name,
        engine.device,
        cfg.model.dtype,
        host,
        port,
    )
    try:
        http_server(create_app(engine, cfg, receiver)).run(sockets=[sock])
    finally:
        if receiver is not None:
            receiver.stop()
        engine.stop()
        sock.close()
    return 0
