"""Request bodies decoded and validated off the event loop when they are large.

FastAPI decodes and validates a body parameter on the event loop, before the route runs: for a 2 MB chat body of
60,000 short messages that is ~80 ms, and 100 such clients at once held the loop (and so /health and every other
request) for seconds. A route takes its body from `parsed_body` instead: a body of at most INLINE_BYTES is
validated on the loop (a thread hop would cost more), a larger one as a job of the prompt workers (prompts.py),
smallest first. A body that is not JSON or not valid is a RequestValidationError, as FastAPI's own would be, which
api_errors.py turns into OpenAI's 400.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from asyncrl.inference.api.prompts import INLINE_BYTES, PromptWorkers

Body = TypeVar("Body", bound=BaseModel)


def parsed_body(
    model: type[Body], workers: PromptWorkers, check: Callable[[Body], None] | None = None
) -> Callable[[Request], Awaitable[Body]]:
    """A FastAPI dependency giving the request's body as `model` (`body: ChatBody = Depends(parsed_body(...))`),
    passed through `check` (which raises a request's error) where given: a walk over every message is work too."""

    async def parse(raw: Request) -> Body:
        content = await raw.body()
        if len(content) <= INLINE_BYTES:
            return validate(model, content, check)
        return await workers.run(len(content), lambda: validate(model, content, check))

    return parse


def validate(model: type[Body], content: bytes, check: Callable[[Body], None] | None = None) -> Body:
    try:
        data = json.loads(content)
    except ValueError as error:  # JSONDecodeError, or bytes in no Unicode encoding
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body",), "msg": f"not JSON: {error}"}]
        ) from None
    try:
        body = model.model_validate(data)
    except ValidationError as error:
        raise RequestValidationError([{**item, "loc": ("body", *item["loc"])} for item in error.errors()]) from None
    if check is not None:
        check(body)
    return body
