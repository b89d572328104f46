"""`/v1/chat/completions`: messages (and tools) rendered by the served model's chat template, the backend's
completions turned into OpenAI's answer or stream, tool calls read from the text (`tool_calls.py`).

`tool_choice` is enforced so (docs/inference.md says the same):
- "auto" (the default with tools): the tools are rendered, the model writes what it wants, and its `<tool_call>`
  blocks become `tool_calls`.
- "none": the tools are rendered (as vLLM does) but nothing is read as a call: the text comes back as written,
  any `<tool_call>` blocks in it included (environments that read calls from the text ask for this).
- "required" and a named function: the assistant's turn starts with the opening of a call (of that function:
  the model writes only its arguments), and each sample must hold a valid call; one that does not is sampled
  again, up to TOOL_CHOICE_ATTEMPTS times (once when greedy), before the request fails with a 422. Streamed,
  such an answer comes in one event per choice, once valid.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from asyncrl.config.schema import InferenceConfig
from asyncrl.inference.api.api_errors import APIError
from asyncrl.inference.api.bodies import parsed_body
from asyncrl.inference.api.chat_processes import ChatProcesses
from asyncrl.inference.api.chat_template import render_chat
from asyncrl.inference.api.disconnect import unless_disconnected
from asyncrl.inference.api.limits import PromptTextLimit, admit
from asyncrl.inference.api.prompts import PromptTokenizer
from asyncrl.inference.api.protocol import (
    ChatBody,
    NamedToolChoice,
    check_model,
    check_supported,
    in_thread,
    prompt_cached_tokens,
    stop_strings,
    usage,
)
from asyncrl.inference.api.streaming import StreamPiece, TokenStream, event_stream, sse, usage_chunk
from asyncrl.inference.api.text import TokenText, chat_logprob_entries, visible_text
from asyncrl.inference.api.token_routes import sampling
from asyncrl.inference.api.tool_calls import OPENER, ToolCall, ToolCallFormat, ToolCallParser, split_tool_calls
from asyncrl.inference.backends.backend import Backend
from asyncrl.inference.engine.sampling import MIN_TEMPERATURE
from asyncrl.inference.engine.sequence import Completion, GenerationRequest

TOOL_CHOICE_ATTEMPTS = 3  # samples per choice for tool_choice "required" or named, at most


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of its generation and its answer."""

    names: frozenset[str] = frozenset()  # functions whose calls are read from the text; empty: none are
    prefill: str = ""  # what the assistant's turn starts with (the opening of a call, if one is required)
    required: str | None = None  # "a tool" or the named function, when the answer must call it
    parallel: bool = True  # False: the first call only


@dataclass
class PreparedChat:
    """A request's body, and its prompt text where a chat-body worker process already rendered it."""

    body: ChatBody
    text: str | None = None


@dataclass
class ChatChoice:
    """One choice of the answer: its text split into content and calls, and the tokens its text covers."""

    content: str | None
    calls: list[ToolCall]
    covered: int
    finish_reason: str


def chat_routes(
    backend: Backend, cfg: InferenceConfig, model_name: str, prompt_work: PromptTokenizer, processes: ChatProcesses
) -> APIRouter:
    router = APIRouter()
    parse = parsed_body(ChatBody, prompt_work.workers, check_supported)

    async def prepare(raw: Request) -> PreparedChat:
        """A large body is decoded, validated and rendered in a worker process (chat_processes.py)."""
        content = await raw.body()
        if processes.takes(len(content)):
            return PreparedChat(*await unless_disconnected(raw, processes.prepare(content)))
        return PreparedChat(await parse(raw))

    chat_body = Depends(prepare)
    tokenizer = backend.tokenizer
    text_limit = PromptTextLimit(tokenizer, cfg.seq_len)
    tokens = TokenText(tokenizer)
    tool_format = ToolCallFormat.of(tokenizer)

    def tool_plan(body: ChatBody) -> ToolPlan:
        names = [_tool_name(index, tool) for index, tool in enumerate(body.tools or [])]
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if names else "none")
        if isinstance(choice, dict):
            raise APIError(
                400,
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if choice == "none":
            return ToolPlan()
        if not names:
            raise APIError(400, f"tool_choice {_describe(choice)} needs tools (give the tools it may call)", "tools")
        if tool_format is None:
            raise APIError(
                400,
                f"the chat template of {model_name} has no {OPENER} convention, so tool calls cannot be read "
                "from its output (serve a model whose template writes <tool_call> JSON, as Qwen's, or send "
                'tool_choice "none")',
                "tools",
            )
        if choice == "auto":
            return ToolPlan(frozenset(names), parallel=body.parallel_tool_calls)
        if choice == "required":
            return ToolPlan(frozenset(names), tool_format.prefill(None), "a tool", body.parallel_tool_calls)
        name = choice.function.name
        if name not in names:
            raise APIError(400, f"tool_choice names '{name}', which is not among the tools", "tool_choice")
        return ToolPlan(frozenset([name]), tool_format.prefill(name), f"'{name}'", body.parallel_tool_calls)

    async def chat_prompt(chat: PreparedChat, plan: ToolPlan, max_tokens: int | None, body_bytes: int) -> list[int]:
        if tokenizer.chat_template is None:
            raise APIError(400, f"model {model_name} has no chat template (use /v1/completions)", "messages")
        text = chat.text
        if text is None:
            text = await prompt_work.prepare(body_bytes, lambda: render_chat(tokenizer, chat.body))
        text_limit.check(text, "messages")
        return await prompt_work.tokenize(text + plan.prefill, body_bytes, max_tokens, special_tokens=False)

    def read_choice(plan: ToolPlan, stop: tuple[str, ...], completion: Completion) -> ChatChoice:
        text, covered = visible_text(tokenizer, completion.token_ids, completion.finish_reason, stop)
        if not plan.names:
            return ChatChoice(text, [], covered, completion.finish_reason)
        content, calls = split_tool_calls(plan.prefill + text, plan.names)
        calls = calls if plan.parallel else calls[:1]
        finish_reason = "tool_calls" if calls and completion.finish_reason == "stop" else completion.finish_reason
        return ChatChoice(content, calls, covered, finish_reason)

    async def generate_with_calls(request: GenerationRequest, plan: ToolPlan) -> tuple[list[Completion], int, int]:
        """The request's samples, each holding a valid call: a sample without one is drawn again, at most
        TOOL_CHOICE_ATTEMPTS times (greedy sampling would draw the same one). Returns them, every token
        generated (the discarded samples' too) and the prompt's cached tokens (of the first draw: usage counts
        the prompt once)."""
        kept: list[Completion | None] = [None] * request.n
        attempts = 1 if request.temperature < MIN_TEMPERATURE else TOOL_CHOICE_ATTEMPTS
        generated = cached = 0
        for attempt in range(attempts):
            missing = [index for index, completion in enumerate(kept) if completion is None]
            seed = None if request.seed is None else request.seed + attempt * request.n  # new draws each round
            results = await backend.generate(dataclasses.replace(request, n=len(missing), seed=seed))
            generated += sum(len(completion.token_ids) for completion in results)
            if attempt == 0:
                cached = prompt_cached_tokens(results)
            choices = await asyncio.to_thread(lambda done: [read_choice(plan, request.stop, c) for c in done], results)
            for index, completion, choice in zip(missing, results, choices):
                if choice.calls:
                    kept[index] = completion
            if all(completion is not None for completion in kept):
                return kept, generated, cached
        raise APIError(
            422,
            f"the model wrote no valid call of {plan.required} in {attempts} attempt{'s' * (attempts > 1)} "
            '(tool_choice asks for one; sample at a higher temperature, or send tool_choice "auto")',
            "tool_choice",
        )

    def chat_answer(
        body: ChatBody,
        plan: ToolPlan,
        request: GenerationRequest,
        completions: list[Completion],
        generated: int,
        cached: int,
    ) -> dict:
        choices = []
        for index, completion in enumerate(completions):
            choice = read_choice(plan, request.stop, completion)
            message: dict[str, Any] = {"role": "assistant", "content": choice.content}
            if choice.calls:
                message["tool_calls"] = [call.as_openai() for call in choice.calls]
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": logprobs_of(body, completion, 0, choice.covered),
                    "finish_reason": choice.finish_reason,
                }
            )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": usage(len(request.prompt_ids), generated, cached),
        }

    def logprobs_of(body: ChatBody, sample: Any, start: int, end: int) -> dict | None:
        if not body.logprobs:
            return None
        span = slice(start, end)
        return {
            "content": chat_logprob_entries(
                tokens, sample.token_ids[span], sample.logprobs[span], sample.top_logprobs[span]
            )
        }

    @router.post("/v1/chat/completions", response_model=None)
    async def chat_completions(raw: Request, chat: PreparedChat = chat_body) -> Response:
        body = chat.body
        check_model(body.model, model_name)
        plan = tool_plan(body)
        asked = body.max_completion_tokens or body.max_tokens
        prompt_ids = await unless_disconnected(raw, chat_prompt(chat, plan, asked, len(await raw.body())))
        max_tokens = asked or max(cfg.seq_len - len(prompt_ids), 1)
        request = GenerationRequest(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            stop=stop_strings(body.stop),
            top_logprobs=body.top_logprobs or 0,
            **sampling(body),
        )
        admit(cfg, backend.vocab_size, [request])

        if plan.required is not None:
            completions, generated, cached = await unless_disconnected(raw, generate_with_calls(request, plan))
            answer = await asyncio.to_thread(chat_answer, body, plan, request, completions, generated, cached)
            return whole_answer_stream(body, answer) if body.stream else JSONResponse(answer)
        if body.stream:
            return chat_stream(body, plan, request)
        completions = await unless_disconnected(raw, backend.generate(request))
        generated = sum(len(completion.token_ids) for completion in completions)
        cached = prompt_cached_tokens(completions)
        return await in_thread(chat_answer, body, plan, request, completions, generated, cached)

    def chat_stream(body: ChatBody, plan: ToolPlan, request: GenerationRequest) -> StreamingResponse:
        stream = TokenStream(backend, [request], tokenizer)
        chat_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        started: set[int] = set()
        parsers = [ToolCallParser(plan.names) for _ in range(request.n)]
        sent_calls = [0] * request.n

        def chunk(piece: StreamPiece) -> dict | None:
            delta: dict[str, Any] = {}
            if piece.choice not in started:
                started.add(piece.choice)
                delta["role"] = "assistant"
            finish_reason = piece.finish_reason
            if not plan.names:
                delta["content"] = piece.text
            else:
                parser = parsers[piece.choice]
                content, calls = parser.feed(piece.text)
                if finish_reason is not None:
                    content += parser.finish()
                if content:
                    delta["content"] = content
                calls = calls[: max(0, 1 - sent_calls[piece.choice])] if not plan.parallel else calls
                if calls:
                    first = sent_calls[piece.choice]
                    delta["tool_calls"] = [{"index": first + k, **call.as_openai()} for k, call in enumerate(calls)]
                    sent_calls[piece.choice] += len(calls)
                if finish_reason == "stop" and sent_calls[piece.choice]:
                    finish_reason = "tool_calls"
            logprobs = logprobs_of(body, piece.sample, piece.start, piece.end)
            if not delta and finish_reason is None and not (logprobs and logprobs["content"]):
                return None  # text held back, nothing to say yet
            return {
                "id": chat_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                "choices": [
                    {"index": piece.choice, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
                ],
            }

        def final() -> dict | None:
            if body.stream_options is None or not body.stream_options.include_usage:
                return None
            return usage_chunk(chat_id, "chat.completion.chunk", model_name, len(request.prompt_ids), stream)

        return event_stream(stream, chunk, final)

    def whole_answer_stream(body: ChatBody, answer: dict) -> StreamingResponse:
        """A finished answer as a stream: per choice one chunk of its role, content, calls and logprobs, then
        one of its finish reason alone (as OpenAI and vLLM end a choice: the client's stream helper fires its
        `arguments.done` events on the calls before that chunk), the usage chunk if asked, [DONE]."""

        def events():
            for choice in answer["choices"]:
                message = choice["message"]
                delta: dict[str, Any] = {"role": "assistant"}
                if message["content"]:
                    delta["content"] = message["content"]
                if "tool_calls" in message:
                    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
                streamed = {"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"]}
                yield sse({**_chunk_header(answer), "choices": [{**streamed, "finish_reason": None}]})
                end = {
                    "index": choice["index"],
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": choice["finish_reason"],
                }
                yield sse({**_chunk_header(answer), "choices": [end]})
            if body.stream_options is not None and body.stream_options.include_usage:
                yield sse({**_chunk_header(answer), "choices": [], "usage": answer["usage"]})
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    return router


def _chunk_header(answer: dict) -> dict:
    return {
        "id": answer["id"],
        "object": "chat.completion.chunk",
        "created": answer["created"],
        "model": answer["model"],
    }


def _tool_name(index: int, tool: dict) -> str:
    """The function name of a tool of the request, checked to be OpenAI's function tool."""
    function = tool.get("function") if tool.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise APIError(
            400,
            f'tools[{index}] is not a function tool: give {{"type": "function", "function": {{"name": ..., '
            '"parameters": {...}}} (other tool types are not supported)',
            f"tools[{index}]",
        )
    return name


def _describe(choice: str | NamedToolChoice) -> str:
    return f'"{choice}"' if isinstance(choice, str) else f"naming '{choice.function.name}'"
