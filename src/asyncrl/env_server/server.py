"""The env-server's HTTP side: environments are registered by the orchestrator, then serve examples, `respond`
and scores.

    POST /environments  {name, args, workers, call_timeout} -> {id, tools, limits}  (idempotent)
    POST /examples      {id, seed | null (eval), start, count} -> {examples}        (fewer at a stream's end)
    POST /respond       {id, messages, state, example, turn} -> {reply, state} | {error, worker_failed}
    POST /score         {id, completion, example, state, messages, turns, is_truncated}
                        -> {reward, metrics, error}
    GET  /health        -> {ready, environments: {id: {name, workers, restarts, failed_calls}}}

Examples are drawn in this process (in a thread, so one environment's data loading does not hold the others
up); `respond` and reward functions run in each environment's worker processes (`workers.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from asyncrl.config.schema import EnvServerConfig
from asyncrl.env_server.workers import WorkerFailed, WorkerPool, example_to_json
from asyncrl.environments import load_environment
from asyncrl.environments.base import Environment, Example
from asyncrl.errors import AsyncRLError
from asyncrl.processes import die_with_parent

log = logging.getLogger("asyncrl.env_server")


class Registration(BaseModel):
    label: str
    name: str
    args: dict = {}
    workers: int = 2
    call_timeout: float = 60.0


class ExamplesRequest(BaseModel):
    id: str
    seed: int | None  # None: the eval examples
    start: int
    count: int


class Served:
    """One registered environment: an instance here for its examples, its workers for the rest."""

    def __init__(self, label: str, env: Environment, pool: WorkerPool):
        self.label, self.env, self.pool = label, env, pool
        self.streams: dict[int | None, tuple[int, Iterator[Example]]] = {}  # seed -> (position, stream)
        self.lock = asyncio.Lock()

    def draw(self, seed: int | None, start: int, count: int) -> list[dict[str, Any]]:
        position, stream = self.streams.get(seed, (0, iter(())))
        if seed not in self.streams or start < position:  # a new reader, or one that went back (a resume)
            position, stream = 0, self.env.eval_examples() if seed is None else self.env.examples(seed)
        batch = list(itertools.islice(stream, start - position, start - position + count))
        self.streams[seed] = (start + len(batch), stream)
        examples = [example_to_json(example) for example in batch]
        try:
            json.dumps(examples)
        except TypeError as e:
            raise AsyncRLError(
                f"environment '{self.label}' yields examples whose info is not JSON ({e}); under an env-server "
                "examples travel as JSON"
            ) from None
        return examples


def create_app() -> FastAPI:
    served: dict[str, Served] = {}
    registering: dict[str, asyncio.Lock] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.gather(*(s.pool.stop() for s in served.values()))

    app = FastAPI(title="asyncrl env-server", lifespan=lifespan)

    def find(env_id: str) -> Served:
        if env_id not in served:
            raise HTTPException(404, f"no environment '{env_id}' is registered here (register it first)")
        return served[env_id]

    @app.get("/health")
    async def health() -> dict:
        environments = {
            key: {
                "name": s.label,
                "workers": s.pool.size,
                "restarts": s.pool.restarts,
                "failed_calls": s.pool.failed_calls,
            }  # fmt: skip
            for key, s in served.items()
        }
        return {"ready": True, "environments": environments}

    @app.post("/environments")
    async def register(body: Registration) -> dict:
        key = hashlib.sha256(json.dumps(body.model_dump(), sort_keys=True).encode()).hexdigest()[:16]
        async with registering.setdefault(key, asyncio.Lock()):
            if key not in served:
                try:
                    env = await asyncio.to_thread(load_environment, body.name, **body.args)
                except AsyncRLError as e:
                    raise HTTPException(400, str(e)) from None
                if type(env).rollout_group is not Environment.rollout_group:
                    raise HTTPException(
                        400,
                        f"environment '{body.name}' plays its own episodes (it overrides rollout_group), which "
                        "an env-server cannot split from generation: run it in the orchestrator (no env_server)",
                    )
                pool = WorkerPool(body.label, body.name, body.args, body.workers, body.call_timeout)
                try:
                    await pool.start()
                except RuntimeError as e:
                    raise HTTPException(400, str(e)) from None
                served[key] = Served(body.label, env, pool)
                log.info("serving environment '%s' (%s) in %d worker(s)", body.label, key, body.workers)
        env = served[key].env
        limits = {"max_turns": env.limits.max_turns, "max_tokens": env.limits.max_tokens,
                  "time_limit": env.limits.time_limit}  # fmt: skip
        return {"id": key, "tools": env.tools, "limits": limits}

    @app.post("/examples")
    async def examples(body: ExamplesRequest) -> dict:
        s = find(body.id)
        async with s.lock:
            try:
                return {"examples": await asyncio.to_thread(s.draw, body.seed, body.start, body.count)}
            except AsyncRLError as e:
                raise HTTPException(400, str(e)) from None

    async def call(env_id: str, method: str, payload: dict) -> dict:
        try:
            return await find(env_id).pool.call(method, payload)
        except WorkerFailed as e:
            return {"error": str(e), "worker_failed": True}
        except RuntimeError as e:
            return {"error": str(e), "worker_failed": False}

    @app.post("/respond")
    async def respond(body: dict) -> dict:
        return await call(body.pop("id"), "respond", body)

    @app.post("/score")
    async def score(body: dict) -> dict:
        return await call(body.pop("id"), "score", body)

    return app


def serve_environments(cfg: EnvServerConfig) -> int:
    if cfg.parent_pid:
        die_with_parent(cfg.parent_pid)  # a local env-server, and its workers, must not outlive the orchestrator
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    server = uvicorn.Server(
        uvicorn.Config(create_app(), host=cfg.host, port=cfg.port, log_level="warning", access_log=False)
    )
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: anyone who reaches it can run environment code by import path", cfg.host)

    log.info("env-server on http://%s:%d", cfg.host, cfg.port)
    asyncio.run(server.serve())
    return 0
