"""The /admin routes the orchestrator drives (each needs the admin token): pause, resume, and make new weights
live. Weight updates are checked here for both backends: a version never goes backwards, and two updates never
interleave."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from asyncrl.config.schema import InferenceConfig
from asyncrl.inference.api.api_errors import APIError
from asyncrl.inference.api.auth import admin_guard
from asyncrl.inference.api.protocol import UpdateWeightsBody
from asyncrl.inference.backends.backend import Backend
from asyncrl.inference.engine.engine import WeightsError


def admin_routes(backend: Backend, cfg: InferenceConfig) -> APIRouter:
    router = APIRouter(prefix="/admin", dependencies=[Depends(admin_guard(cfg))])
    # One control operation at a time: a pause must not land between the pause and the resume of an update.
    control = asyncio.Lock()

    @router.post("/pause")
    async def pause() -> dict:
        async with control:
            await backend.pause()
        return {"paused": True, "policy_version": backend.policy_version}

    @router.post("/resume")
    async def resume() -> dict:
        async with control:
            await backend.resume()
        return {"paused": False, "policy_version": backend.policy_version}

    @router.post("/update_weights")
    async def update_weights(body: UpdateWeightsBody) -> dict:
        async with control:
            live = backend.policy_version
            version = body.version
            if body.path is None:
                # A broadcast serves the newest version received, which may already be live and newer.
                version = max(version, live)
            elif version < live:
                raise APIError(
                    400,
                    f"version {body.version} is older than the live policy version {live} (versions never go "
                    "backwards; give the trainer's newest step)",
                    "version",
                )
            try:
                version = await backend.update_weights(body.path, version)
            except WeightsError as error:
                raise APIError(400, str(error), "path") from None
        return {"policy_version": version}

    return router
