"""Stop working for a client who left. A client that times out or disconnects (the orchestrator cancelling a
stale group, an eval script killed) must not leave its samples decoding to max_tokens for no one: the route's
work is cancelled, and with it the backend's. Streaming responses get the same from Starlette, which stops the
stream when the client goes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client left before its answer was ready; there is nobody to answer."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client goes away first. The route has read its body by now, so the
    next ASGI message can only be the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        left = not task.done()
        if left:
            task.cancel()
    if left:
        raise ClientDisconnected
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def install_disconnect_handler(app: FastAPI) -> None:
    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
