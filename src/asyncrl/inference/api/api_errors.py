"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, on every route and for every
failure, so that the `openai` client raises the matching class and no client ever gets a plain-text 500."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from asyncrl.errors import AsyncRLError
from asyncrl.inference.engine.sequence import RequestError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",  # well-formed, but the model did not write what tool_choice asks for
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


def field_path(loc: tuple) -> str:
    """pydantic's error location as the request field's name, `messages[0].content`: the list indexes in
    brackets, and nothing past the field itself, where pydantic names the union member it tried
    (`tool_choice.literal['none','auto','required']`, `messages.0.content.str`, `...NamedToolChoice`)."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif not part.isidentifier() or not part.islower() or part in UNION_MEMBER_TAGS:
            break
        else:
            path += f".{part}" if path else part
    return path


# Union members pydantic names by type in an error's location (besides names with brackets or capitals).
UNION_MEMBER_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        parts, params = [], []
        for item in error.errors():
            where = field_path(item["loc"])
            parts.append(f"{where}: {item['msg']}" if where else item["msg"])
            params.append(where)
        return error_response(400, "; ".join(parts), next((p for p in params if p), None))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, error: HTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail), getattr(error, "param", None))

    @app.exception_handler(RequestError)
    async def _bad_request(_: Request, error: RequestError) -> JSONResponse:
        return error_response(400, str(error))

    @app.exception_handler(AsyncRLError)
    async def _failed(_: Request, error: AsyncRLError) -> JSONResponse:
        return error_response(500, str(error))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        # A bug of ours: uvicorn logs the traceback, the client gets one line in the promised shape.
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        return error_response(500, f"internal error: {type(error).__name__}: {first_line} (see the server log)")
