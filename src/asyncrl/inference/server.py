"""The HTTP front of the inference engine: FastAPI routes that translate requests, never tensors.

Routes (see docs/inference.md for the JSON):
- `POST /v1/generate`: token ids in, token ids + per-token logprobs + policy versions out (the trainer's path);
- `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`: OpenAI-compatible, for eval and tools;
- `GET /health`, `GET /metrics` (Prometheus text);
- `POST /admin/pause`, `/admin/resume`, `/admin/update_weights`: need `Authorization: Bearer <admin token>`.

Handlers are async and never block the event loop: they hand work to the engine's decoding thread and
await its `concurrent.futures.Future` through an asyncio future resolved with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import hmac
import itertools
import logging
import os
import socket
import time
import uuid
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from asyncrl.config.schema import InferenceConfig
from asyncrl.errors import AsyncRLError
from asyncrl.inference.engine import MAX_TOP_LOGPROBS, Completion, Engine, GenerationRequest, RequestError, WeightsError

log = logging.getLogger("asyncrl.inference")

WEIGHT_UPDATE_TIMEOUT = 600.0  # seconds until /admin/update_weights gives up waiting (the load may still land)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of seq_len


# ---- request bodies ----


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")  # our own route: a misspelled field is an error, not a default

    prompt_ids: list[int] = Field(min_length=1)
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(64, ge=1)
    stop_token_ids: list[int] = []
    seed: int | None = None


class OpenAIBody(BaseModel):
    # OpenAI clients send fields we do not implement (user, penalties, ...): accepted and ignored.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False


class ChatBody(OpenAIBody):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionBody(OpenAIBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    version: int = Field(ge=0)


# ---- errors in OpenAI's shape: {"error": {"message", "type", "code"}} ----

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    504: "timeout_error",
}


def error_response(status: int, message: str) -> JSONResponse:
    error_type = ERROR_TYPES.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": error_type, "code": status}}, status_code=status)


def _validation_message(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"] if p != "body")
        parts.append(f"{where}: {item['msg']}" if where else item["msg"])
    return "; ".join(parts)


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


def _copy_outcome(done: concurrent.futures.Future, waiter: asyncio.Future) -> None:
    if waiter.done():
        return
    if done.cancelled():
        waiter.cancel()
    elif done.exception() is not None:
        waiter.set_exception(done.exception())
    else:
        waiter.set_result(done.result())


# ---- the app ----


def create_app(engine: Engine, cfg: InferenceConfig) -> FastAPI:
    app = FastAPI(title="asyncrl inference", docs_url=None, redoc_url=None)
    tokenizer = engine.tokenizer
    model_name = cfg.model.name
    admin_token = cfg.admin_token or os.environ.get("ASYNCRL_ADMIN_TOKEN") or None

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(400, _validation_message(error))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, error: HTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail))

    @app.exception_handler(RequestError)
    async def _bad_request(_: Request, error: RequestError) -> JSONResponse:
        return error_response(400, str(error))

    def require_admin(request: Request) -> None:
        if admin_token is None:
            raise HTTPException(
                403,
                "admin routes are disabled: set inference.admin_token or the "
                "ASYNCRL_ADMIN_TOKEN environment variable of the server",
            )
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), admin_token.encode()):
            raise HTTPException(401, "missing or wrong admin token (send 'Authorization: Bearer <token>')")

    async def run(request: GenerationRequest) -> list[Completion]:
        return await wait_for_engine(engine.generate(request))

    # ---- status ----

    @app.get("/health")
    async def health() -> dict:
        stats = engine.stats()
        return {"ready": True, "model": model_name, "policy_version": stats.policy_version, "paused": stats.paused}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = engine.stats()
        lines = []
        for name, kind, help_text, value in (
            ("running_sequences", "gauge", "Sequences in the decoding batch.", stats.running_sequences),
            ("waiting_sequences", "gauge", "Sequences queued for the next batch.", stats.waiting_sequences),
            ("generated_tokens_total", "counter", "Tokens sampled since start.", stats.generated_tokens),
            ("policy_version", "gauge", "Policy version of the live weights (0 = base model).", stats.policy_version),
            ("paused", "gauge", "1 while decoding is paused by /admin/pause.", int(stats.paused)),
        ):
            metric = f"asyncrl_inference_{name}"
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}", f"{metric} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # ---- tokens in, tokens out ----

    @app.post("/v1/generate")
    async def generate(body: GenerateBody) -> dict:
        completions = await run(
            GenerationRequest(
                prompt_ids=body.prompt_ids,
                n=body.n,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                max_tokens=body.max_tokens,
                stop_token_ids=tuple(body.stop_token_ids),
                seed=body.seed,
            )
        )
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

    # ---- OpenAI-compatible ----

    def openai_request(
        body: OpenAIBody, prompt_ids: list[int], max_tokens: int, top_logprobs: int
    ) -> GenerationRequest:
        if body.stream:
            raise HTTPException(400, "stream=true is not supported yet (send stream=false)")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        return GenerationRequest(
            prompt_ids=prompt_ids,
            n=body.n,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=max_tokens,
            stop=tuple(s for s in stop if s),
            seed=body.seed,
            top_logprobs=top_logprobs,
        )

    def usage(prompt_tokens: int, completions: list[Completion]) -> dict:
        generated = sum(len(c.token_ids) for c in completions)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "asyncrl"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody) -> dict:
        if tokenizer.chat_template is None:
            raise HTTPException(400, f"model {model_name} has no chat template (use /v1/completions)")
        messages = [_flatten_content(message) for message in body.messages]
        try:
            prompt_ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as error:  # noqa: BLE001 - a template error is the request's fault
            raise HTTPException(400, f"messages do not fit the chat template: {error}") from None
        max_tokens = body.max_completion_tokens or body.max_tokens or max(cfg.seq_len - len(prompt_ids), 1)
        request = openai_request(body, prompt_ids, max_tokens, body.top_logprobs or 0)
        completions = await run(request)
        choices = []
        for index, completion in enumerate(completions):
            text, covered = visible_text(tokenizer, completion, request.stop)
            choices.append(
                {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": chat_logprobs(tokenizer, completion, covered) if body.logprobs else None,
                    "finish_reason": completion.finish_reason,
                }
            )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": usage(len(prompt_ids), completions),
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> dict:
        if body.echo:
            raise HTTPException(400, "echo=true is not supported (send echo=false)")
        prompts = _prompt_list(body.prompt, tokenizer)
        max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        requests = [openai_request(body, ids, max_tokens, body.logprobs or 0) for ids in prompts]
        # Every prompt is queued before any is awaited, so they share decoding batches.
        futures: list[concurrent.futures.Future] = []
        try:
            for request in requests:
                futures.append(engine.generate(request))
        except RequestError:
            for future in futures:
                future.cancel()
            raise
        results = await asyncio.gather(*(wait_for_engine(future) for future in futures))
        choices = []
        for request, completion in ((r, c) for r, result in zip(requests, results) for c in result):
            text, covered = visible_text(tokenizer, completion, request.stop)
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(tokenizer, completion, covered, request.top_logprobs > 0)
            choices.append(
                {"index": len(choices), "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason}
            )
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": usage(sum(len(ids) for ids in prompts), [c for result in results for c in result]),
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
        try:
            version = await wait_for_engine(engine.update_weights(body.path, body.version), WEIGHT_UPDATE_TIMEOUT)
        except WeightsError as error:
            raise HTTPException(400, str(error)) from None
        except TimeoutError:
            raise HTTPException(
                504, f"weights from '{body.path}' not live after {WEIGHT_UPDATE_TIMEOUT:.0f}s"
            ) from None
        return {"policy_version": version}

    return app


# ---- OpenAI response pieces ----


def visible_text(tokenizer: Any, completion: Completion, stop: tuple[str, ...]) -> tuple[str, int]:
    """The text OpenAI clients see and how many tokens it covers: cut before the first stop string, and
    without the EOS / stop token that ended the sample (usage still counts every generated token)."""
    ids = completion.token_ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stop if s in text]
    if cuts:
        text = text[: min(cuts)]
        # The fewest tokens whose text reaches the cut; decoded lengths grow with the prefix.
        low, high = 0, len(ids)
        while low < high:
            middle = (low + high) // 2
            if len(tokenizer.decode(ids[:middle], skip_special_tokens=True)) >= len(text):
                high = middle
            else:
                low = middle + 1
        return text, low
    if completion.finish_reason == "stop":
        return text, len(ids) - 1
    return text, len(ids)


def chat_logprobs(tokenizer: Any, completion: Completion, covered: int) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for t in range(covered):
        top = completion.top_logprobs[t] if completion.top_logprobs else []
        content.append(
            {**entry(completion.token_ids[t], completion.logprobs[t]), "top_logprobs": [entry(*pair) for pair in top]}
        )
    return {"content": content}


def completion_logprobs(tokenizer: Any, completion: Completion, covered: int, with_top: bool) -> dict:
    tokens = [tokenizer.decode([token_id]) for token_id in completion.token_ids[:covered]]
    return {
        "tokens": tokens,
        "token_logprobs": completion.logprobs[:covered],
        "top_logprobs": [
            {tokenizer.decode([i]): lp for i, lp in completion.top_logprobs[t]} if with_top else None
            for t in range(covered)
        ],
        "text_offset": [0, *itertools.accumulate(len(token) for token in tokens)][:covered],
    }


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
        raise HTTPException(400, "prompt is empty")
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


def serve(cfg: InferenceConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sock = bind_socket(cfg.host, cfg.port)
    try:
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
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(engine, cfg),
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()
    return 0
