"""`asyncrl inference`: the HTTP server in front of a backend, and the app that assembles its routes.

The HTTP layer only translates; it never touches tensors. Its parts:
- `protocol.py`: request bodies and the bounds of every field; `api_errors.py`: OpenAI's error shape;
- `limits.py`: what one request may ask (body size, samples, stop strings); `auth.py`: API key, admin token;
- `prompts.py`: rendering and tokenizing prompts on threads of their own, stopped when the client leaves;
- `token_routes.py`: `/v1/generate`, `/inference/v1/generate`; `openai_routes.py`: `/v1/completions`,
  `/v1/models`, and `/v1/chat/completions` from `chat_routes.py` (tools: `tool_calls.py`); `admin_routes.py`:
  `/admin/pause|resume|update_weights`;
- `backends/backend.py`: what the routes need of an engine, served by `backends/native_backend.py` (our engine,
  in this process) or `backends/vllm_backend.py` (a vLLM child process, `backends/vllm_process.py`). The same
  app serves both.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from asyncrl.config.schema import InferenceConfig
from asyncrl.errors import AsyncRLError
from asyncrl.inference.api.admin_routes import admin_routes
from asyncrl.inference.api.api_errors import error_response, install_error_handlers
from asyncrl.inference.api.auth import api_key_guard, warn_if_exposed
from asyncrl.inference.api.chat_processes import ChatProcesses
from asyncrl.inference.api.disconnect import install_disconnect_handler
from asyncrl.inference.api.limits import BodySizeLimit, LargeBodyQueue
from asyncrl.inference.api.openai_routes import openai_routes
from asyncrl.inference.api.prompts import PromptWorkers
from asyncrl.inference.api.token_routes import token_routes
from asyncrl.inference.backends.backend import Backend
from asyncrl.inference.backends.native_backend import NativeBackend
from asyncrl.inference.engine.engine import Engine
from asyncrl.loading import resolve_device
from asyncrl.transport.transfer import make_source

log = logging.getLogger("asyncrl.inference")


def served_model_name(cfg: InferenceConfig) -> str:
    return cfg.served_model_name or cfg.model.name


def create_app(backend: Backend, cfg: InferenceConfig) -> FastAPI:
    chat_processes = ChatProcesses(cfg.model.name, cfg.chat_processes)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        chat_processes.close()

    app = FastAPI(title="asyncrl inference", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    install_error_handlers(app)
    install_disconnect_handler(app)
    app.add_middleware(LargeBodyQueue)
    app.add_middleware(BodySizeLimit, max_bytes=cfg.max_request_bytes)  # outside the queue: a 413 never waits
    model_name = served_model_name(cfg)
    prompt_workers = PromptWorkers()

    async def health() -> dict:
        await backend.check_ready()
        return {
            "ready": True,
            "model": model_name,
            "policy_version": backend.policy_version,
            "paused": backend.paused,
            "backend": backend.name,
        }

    # Added last, so outermost: /health reads no body, takes no lock and waits for no route, thread or queue.
    app.add_middleware(HealthRoute, health=health)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = await backend.metrics() + prompt_workers.metrics() + chat_processes.metrics()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    clients = [Depends(api_key_guard(cfg))]
    app.include_router(token_routes(backend, cfg, model_name, prompt_workers), dependencies=clients)
    app.include_router(openai_routes(backend, cfg, model_name, prompt_workers, chat_processes), dependencies=clients)
    app.include_router(admin_routes(backend, cfg))
    return app


class HealthRoute:
    """ASGI middleware answering `GET /health` before any other layer: the event loop is all it needs, and no
    request work runs on the loop long (prompts: prompts.py; answers: protocol.in_thread)."""

    def __init__(self, app: Any, health: Callable[[], Awaitable[dict]]):
        self.app = app
        self.health = health

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/health" or scope["method"] not in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        try:
            response: Response = JSONResponse(await self.health())
        except HTTPException as error:
            response = error_response(error.status_code, str(error.detail))
        await response(scope, receive, send)


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


def start_native(cfg: InferenceConfig) -> NativeBackend:
    # Broadcast: the receiver starts joining trainer rank 0's group now, and keeps trying until it is there.
    weights = make_source(cfg.weight_transfer, resolve_device(cfg.device))
    try:
        return NativeBackend(Engine(cfg), weights)
    except BaseException:
        weights.stop()
        raise


# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms). Rendering a huge chat
# body is pure Python on a prompt thread; at 5 ms the decoding thread, which takes the GIL back between its torch
# calls, waited up to 5 ms each time, and a good request beside 200 hostile ones took 7.4 s at worst (1 ms: 2.5 s;
# benchmarks/hostile_load.py). Serving speed was the same at both (tiny model, CPU).
GIL_SWITCH_INTERVAL_S = 0.001


def serve(cfg: InferenceConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # SIGTERM (the launcher stopping us) must run the `finally` below, also while the backend starts.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    sock = bind_socket(cfg.host, cfg.port)
    try:
        if cfg.backend == "vllm":
            from asyncrl.inference.backends.vllm_backend import start_vllm

            backend: Backend = start_vllm(cfg)
        else:
            backend = start_native(cfg)
    except BaseException:
        sock.close()
        raise
    # The backend's start-up heap (torch, transformers, the model's modules) is never freed; frozen, a full
    # collection skips it. Unfrozen, each one walked it for 160-270 ms with the GIL held, and /health waited
    # behind it (benchmarks/hostile_load.py).
    gc.collect()
    gc.freeze()
    host, port = sock.getsockname()[:2]
    warn_if_exposed(cfg, host)
    name = served_model_name(cfg)
    alias = f" as '{name}'" if name != cfg.model.name else ""
    log.info("serving %s%s (policy version 0, %s) on http://%s:%d", cfg.model.name, alias, backend.summary, host, port)
    server = http_server(create_app(backend, cfg))
    backend.watch(lambda: setattr(server, "should_exit", True))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        backend.close()
    return 0
