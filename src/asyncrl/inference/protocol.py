"""The request bodies of every route, with the bounds of every field, and the small answer shapes they share.

Our own routes (`/v1/generate`, `/admin/...`) refuse unknown fields: a misspelled field must not silently fall
back to a default. The OpenAI and vLLM-shaped bodies accept and ignore fields we do not implement, as their
clients send many. Numbers are finite and fit in 64 bits; the server's own limits (n, stop strings, body size)
are checked in `limits.py`, and what depends on the model (token ids, seq_len) in `sequence.check_request`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from asyncrl.inference.api_errors import APIError
from asyncrl.inference.sequence import MAX_TOP_LOGPROBS

MAX_POLICY_VERSION = 2**31 - 1  # a trainer step; anything larger is a mistake

Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]
TokenId = Annotated[int, Field(ge=0, lt=2**63)]
Temperature = Annotated[float, Field(ge=0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1, lt=2**63)]


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[TokenId] = Field(min_length=1)
    n: Count = 1
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Field(ge=0, lt=2**63)] = 0
    min_p: MinP = 0.0
    max_tokens: Count = 64
    stop_token_ids: list[Int64] = []
    seed: Int64 | None = None
    ignore_eos: bool = False


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class OpenAIBody(BaseModel):
    # OpenAI clients send fields we do not implement (user, penalties, ...): accepted and ignored.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: Count = 1
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Field(ge=0, lt=2**63)] = 0
    min_p: MinP = 0.0
    max_tokens: Count | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Tool calls, names and the like go to the chat template as they came.
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """Templates of small models expect the content as one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**self.model_dump(exclude={"content"}), "content": content or ""}


class ChatBody(OpenAIBody):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionBody(OpenAIBody):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False


class TokenSamplingParams(BaseModel):
    # vLLM's SamplingParams has many more fields (penalties, detokenize, ...): accepted and ignored.
    model_config = ConfigDict(extra="ignore")

    n: Count = 1
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Field(ge=-1, lt=2**63)] = 0  # vLLM spells "no limit" -1 or 0
    min_p: MinP = 0.0
    max_tokens: Count | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    seed: Int64 | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    ignore_eos: bool = False


class TokenGenerateBody(BaseModel):
    """vLLM's `/inference/v1/generate` request, the subset a token-level client needs."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: TokenSamplingParams = TokenSamplingParams()
    stream: bool = False


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = None  # None: the newest version >= `version` received by weight broadcast
    version: int = Field(ge=0, le=MAX_POLICY_VERSION)


async def in_thread(answer: Callable[..., dict], *args: Any) -> Response:
    """An answer built and serialized in a worker thread: with n = 128 and top logprobs it is tens of MB of
    JSON, seconds of work the event loop (every other client, /health) must not wait for."""
    return await asyncio.to_thread(lambda: Response(json_bytes(answer(*args)), media_type="application/json"))


def json_bytes(value: Any) -> bytes:
    """JSON of `value`, as Starlette's JSONResponse writes it, made in pieces: one `json.dumps` of a large answer
    holds the GIL, and so the event loop, for a second; pieces let the loop run in between."""
    return _json_text(value).encode()


def _json_text(value: Any) -> str:
    """Dicts key by key, lists of containers item by item (an answer's choices), anything else at once."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{_dumps(str(key))}:{_json_text(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list) and value and isinstance(value[0], dict | list):
        return "[" + ",".join(_dumps(item) for item in value) + "]"
    return _dumps(value)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_card(model_name: str, seq_len: int) -> dict:
    # max_model_len: vLLM's field for the prompt + completion bound, which eval clients read.
    return {"id": model_name, "object": "model", "created": 0, "owned_by": "asyncrl", "max_model_len": seq_len}


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return tuple(s for s in stop if s)


def check_model(requested: str | None, served: str) -> None:
    """A request may leave `model` out; naming another model is a 404, as OpenAI and vLLM answer."""
    if requested is not None and requested != served:
        raise APIError(404, f"model '{requested}' is not served here (this server serves '{served}')", "model")
