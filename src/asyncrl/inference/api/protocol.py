"""The request bodies of every route, with the bounds of every field, and the small answer shapes they share.

Our own routes (`/v1/generate`, `/admin/...`) refuse unknown fields: a misspelled field must not silently fall
back to a default. The OpenAI bodies declare every field of OpenAI's API: each is implemented, or refused with
a 400 naming it when it asks for something we do not do (`unsupported`), or, for the few that only label a
request (`user`, `metadata`, ...), accepted without effect. Fields outside OpenAI's API (vLLM's extensions,
which clients such as verifiers send) are ignored unless listed here, as in the vLLM-shaped token route's
`sampling_params`. Numbers are finite and fit in 64 bits; the server's own limits (n, stop strings, body size)
are checked in `limits.py`, and what depends on the model (token ids, seq_len) in `sequence.check_request`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from asyncrl.inference.api.api_errors import APIError
from asyncrl.inference.engine.sequence import MAX_TOP_LOGPROBS, Completion

MAX_POLICY_VERSION = 2**31 - 1  # a trainer step; anything larger is a mistake

Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]
TokenId = Annotated[int, Field(ge=0, lt=2**63)]
Temperature = Annotated[float, Field(ge=0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1, lt=2**63)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]  # OpenAI's and vLLM's bounds
RepetitionPenalty = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]


class LogitAdjustmentFields(BaseModel):
    """logit_bias (token id -> bias, JSON keys as strings) and the penalties; see sampling.LogitAdjustments."""

    logit_bias: dict[TokenId, Bias] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0


class GenerateBody(LogitAdjustmentFields):
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
    return_routed_experts: bool = False  # MoE models: the experts each token went to (router replay)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class OpenAIBody(LogitAdjustmentFields):
    # Fields outside OpenAI's API (vLLM's extensions other than those below) are ignored.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: Count = 1
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Field(ge=0, lt=2**63)] = 0  # vLLM's extension
    min_p: MinP = 0.0  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension: sample on past EOS until max_tokens (benchmarks)
    max_tokens: Count | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Labels of a request, for OpenAI's own bookkeeping: accepted, without effect on the answer.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first field that asks for something this server does not do, or None."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream=true"
        return None


class ContentPart(BaseModel):
    """A part of a message's content. Only text parts are served: the models are text-only."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Tool calls, names and the like go to the chat template as they came.
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """Templates of small models expect the content as one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        return {**self.model_dump(exclude={"content"}), "content": content or ""}

    def unsupported_part(self) -> tuple[int, str] | None:
        """(index, why) of the first content part that is not text, or None."""
        for index, part in enumerate(self.content if isinstance(self.content, list) else []):
            if part.type != "text":
                return index, f"{part.type} parts are not supported: this server serves text-only models"
            if part.text is None:
                return index, "a text part needs its text"
        return None


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's


class ChatBody(OpenAIBody):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    # Asked for things this server does not do: refused when given (see `unsupported`).
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        for index, message in enumerate(self.messages):
            if message.role not in CHAT_ROLES:
                return f"messages[{index}].role", f"role {message.role!r} is not one of: {', '.join(CHAT_ROLES)}"
            if message.content is None and message.role != "assistant":  # an assistant may only call tools
                return f"messages[{index}].content", f"a {message.role} message needs its content"
            part = message.unsupported_part()
            if part is not None:
                return f"messages[{index}].content[{part[0]}]", part[1]
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        response_type = (self.response_format or {}).get("type", "text")
        if response_type != "text":
            return "response_format", (
                f"response_format {response_type!r} is not supported: the output is not constrained to JSON "
                "(ask for JSON in the prompt, or leave response_format out)"
            )
        if self.store:
            return "store", "store=true is not supported: this server keeps no completions"
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities", "only the text modality is served"
        if self.functions is not None or self.function_call is not None:
            field = "functions" if self.functions is not None else "function_call"
            return field, f"{field} is not supported (the deprecated form): send tools and tool_choice"
        for field in ("audio", "prediction", "reasoning_effort", "verbosity", "web_search_options"):
            if getattr(self, field) is not None:
                return field, f"{field} is not supported by this server (leave it out)"
        return super().unsupported()


class CompletionBody(OpenAIBody):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: Count | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo=true is not supported (send echo=false)"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported: every sample is returned (ask for n samples instead)"
        if self.suffix:
            return "suffix", "suffix is not supported: this server does not fill in the middle"
        return super().unsupported()


class TokenSamplingParams(LogitAdjustmentFields):
    # vLLM's SamplingParams has many more fields (detokenize, min_tokens, ...): accepted and ignored.
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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage. `prompt_tokens_details.cached_tokens` (prompt tokens read from the prefix cache) is always
    there, 0 without the cache, so that clients can rely on it."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def prompt_cached_tokens(completions: list[Completion]) -> int:
    """The cached tokens of a request's prompt, which usage counts once however many samples it has (as vLLM
    does): its first sample's, whose prefill computed the prompt (a sample admitted after it may find more of the
    prompt cached, in the blocks the first one wrote)."""
    return completions[0].cached_tokens if completions else 0


def model_card(model_name: str, seq_len: int) -> dict:
    # max_model_len: vLLM's field for the prompt + completion bound, which eval clients read.
    return {"id": model_name, "object": "model", "created": 0, "owned_by": "asyncrl", "max_model_len": seq_len}


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return tuple(s for s in stop if s)


def check_supported(body: OpenAIBody) -> None:
    """A 400 naming the first field of `body` that asks for something this server does not do."""
    problem = body.unsupported()
    if problem is not None:
        raise APIError(400, problem[1], problem[0])


def check_model(requested: str | None, served: str) -> None:
    """A request may leave `model` out; naming another model is a 404, as OpenAI and vLLM answer."""
    if requested is not None and requested != served:
        raise APIError(404, f"model '{requested}' is not served here (this server serves '{served}')", "model")


def check_unicode(value: Any, param: str) -> None:
    """JSON may carry lone surrogates ("\\ud800"), which no tokenizer can encode: a 400, not a crash."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError as error:
        bad = error.object[error.start : error.end].encode("unicode_escape").decode()
        raise APIError(400, f"{param} holds {bad}, a lone surrogate, which is not valid Unicode", param) from None
