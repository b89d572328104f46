"""The OpenAI-compatible routes: `/v1/chat/completions`, `/v1/completions` (streaming too) and `/v1/models`.

They translate: messages or prompts into token ids (the served model's chat template and tokenizer), then the
backend's completions into OpenAI's answer (text cut at stop strings, logprob entries, usage). Tokenizing and
building answers run in worker threads: a long prompt or a long answer with top logprobs must not hold the
event loop, which serves every other client (and /health).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from asyncrl.config.schema import InferenceConfig
from asyncrl.inference.api_errors import APIError
from asyncrl.inference.backend import Backend
from asyncrl.inference.disconnect import unless_disconnected
from asyncrl.inference.limits import admit
from asyncrl.inference.protocol import (
    ChatBody,
    CompletionBody,
    OpenAIBody,
    check_model,
    in_thread,
    model_card,
    stop_strings,
    usage,
)
from asyncrl.inference.sequence import Completion, GenerationRequest
from asyncrl.inference.streaming import StreamPiece, TokenStream, event_stream
from asyncrl.inference.text import TokenText, chat_logprob_entries, completion_logprobs, visible_text
from asyncrl.inference.token_routes import sampling

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of seq_len


def openai_routes(backend: Backend, cfg: InferenceConfig, model_name: str) -> APIRouter:
    router = APIRouter()
    tokenizer = backend.tokenizer
    tokens = TokenText(tokenizer)

    def request_for(body: OpenAIBody, prompt_ids: list[int], max_tokens: int, top_logprobs: int) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            stop=stop_strings(body.stop),
            top_logprobs=top_logprobs,
            **sampling(body),
        )

    def usage_event(body: OpenAIBody, obj: str, stream_id: str, prompt_tokens: int, stream: TokenStream):
        def final() -> dict | None:
            if body.stream_options is None or not body.stream_options.include_usage:
                return None
            return {
                "id": stream_id,
                "object": obj,
                "created": int(time.time()),
                "model": model_name,
                "choices": [],
                "usage": usage(prompt_tokens, stream.completion_tokens()),
            }

        return final

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(model_name, cfg.seq_len)]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id, model_name)
        return model_card(model_name, cfg.seq_len)

    # ---- chat ----

    def chat_prompt(body: ChatBody) -> list[int]:
        if tokenizer.chat_template is None:
            raise APIError(400, f"model {model_name} has no chat template (use /v1/completions)", "messages")
        messages = [message.for_template() for message in body.messages]
        check_unicode({"messages": messages, "tools": body.tools}, "messages")
        try:
            return tokenizer.apply_chat_template(
                messages, tools=body.tools, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as error:  # noqa: BLE001 - a template error is the request's fault
            raise APIError(400, f"messages do not fit the chat template: {error}", "messages") from None

    def chat_answer(body: ChatBody, request: GenerationRequest, completions: list[Completion], chat_id: str) -> dict:
        choices = []
        for index, completion in enumerate(completions):
            text, covered = visible_text(tokenizer, completion.token_ids, completion.finish_reason, request.stop)
            logprobs = None
            if body.logprobs:
                span = slice(0, covered)
                content = chat_logprob_entries(
                    tokens, completion.token_ids[span], completion.logprobs[span], completion.top_logprobs[span]
                )
                logprobs = {"content": content}
            choices.append(
                {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs,
                    "finish_reason": completion.finish_reason,
                }
            )
        return {
            "id": chat_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": usage(len(request.prompt_ids), sum(len(c.token_ids) for c in completions)),
        }

    @router.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatBody, raw: Request) -> JSONResponse | StreamingResponse:
        check_model(body.model, model_name)
        prompt_ids = await asyncio.to_thread(chat_prompt, body)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(cfg.seq_len - len(prompt_ids), 1)
        request = request_for(body, prompt_ids, max_tokens, body.top_logprobs or 0)
        admit(cfg, backend.vocab_size, [request])
        chat_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        if body.stream:
            stream = TokenStream(backend, [request], tokenizer)
            started: set[int] = set()

            def chunk(piece: StreamPiece) -> dict:
                delta: dict[str, Any] = {"content": piece.text}
                if piece.choice not in started:
                    started.add(piece.choice)
                    delta["role"] = "assistant"
                sample = piece.sample
                logprobs = None
                if body.logprobs:
                    span = slice(piece.start, piece.end)
                    content = chat_logprob_entries(
                        tokens, sample.token_ids[span], sample.logprobs[span], sample.top_logprobs[span]
                    )
                    logprobs = {"content": content}
                choice = {"index": piece.choice, "delta": delta, "logprobs": logprobs}
                choice["finish_reason"] = piece.finish_reason
                return {
                    "id": chat_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model_name,
                    "choices": [choice],
                }

            final = usage_event(body, "chat.completion.chunk", chat_id, len(prompt_ids), stream)
            return event_stream(stream, chunk, final)

        completions = await unless_disconnected(raw, backend.generate(request))
        return await in_thread(chat_answer, body, request, completions, chat_id)

    # ---- completions ----

    def completion_prompts(body: CompletionBody) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        check_unicode(prompt, "prompt")
        return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]

    def completions_answer(
        body: CompletionBody, requests: list[GenerationRequest], results: list[list[Completion]], completion_id: str
    ) -> dict:
        choices = []
        for request, completion in ((r, c) for r, result in zip(requests, results) for c in result):
            text, covered = visible_text(tokenizer, completion.token_ids, completion.finish_reason, request.stop)
            logprobs = None
            if body.logprobs is not None:
                span = slice(0, covered)
                logprobs = completion_logprobs(
                    tokens,
                    completion.token_ids[span],
                    completion.logprobs[span],
                    completion.top_logprobs[span],
                    bool(body.logprobs),
                )
            choices.append(
                {"index": len(choices), "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason}
            )
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": usage(
                sum(len(r.prompt_ids) for r in requests), sum(len(c.token_ids) for result in results for c in result)
            ),
        }

    @router.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody, raw: Request) -> JSONResponse | StreamingResponse:
        check_model(body.model, model_name)
        if body.echo:
            raise APIError(400, "echo=true is not supported (send echo=false)", "echo")
        prompts = await asyncio.to_thread(completion_prompts, body)
        max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        requests = [request_for(body, ids, max_tokens, body.logprobs or 0) for ids in prompts]
        admit(cfg, backend.vocab_size, requests)
        completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        if body.stream:
            stream = TokenStream(backend, requests, tokenizer)

            def chunk(piece: StreamPiece) -> dict:
                sample = piece.sample
                logprobs = None
                if body.logprobs is not None:
                    span = slice(piece.start, piece.end)
                    offset = len(sample.sent_text) - len(piece.text)
                    logprobs = completion_logprobs(
                        tokens,
                        sample.token_ids[span],
                        sample.logprobs[span],
                        sample.top_logprobs[span],
                        bool(body.logprobs),
                        offset,
                    )
                choice = {"index": piece.choice, "text": piece.text, "logprobs": logprobs}
                choice["finish_reason"] = piece.finish_reason
                return {
                    "id": completion_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [choice],
                }

            prompt_tokens = sum(len(ids) for ids in prompts)
            final = usage_event(body, "text_completion", completion_id, prompt_tokens, stream)
            return event_stream(stream, chunk, final)

        results = await unless_disconnected(raw, generate_all(backend, requests))
        return await in_thread(completions_answer, body, requests, results, completion_id)

    return router


async def generate_all(backend: Backend, requests: list[GenerationRequest]) -> list[list[Completion]]:
    """Every prompt's completions. All are queued before any is awaited, so they share decoding batches; if
    one fails, the others are cancelled."""
    tasks = [asyncio.ensure_future(backend.generate(request)) for request in requests]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


def check_unicode(value: Any, param: str) -> None:
    """JSON may carry lone surrogates ("\\ud800"), which no tokenizer can encode: a 400, not a crash."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError as error:
        bad = error.object[error.start : error.end].encode("unicode_escape").decode()
        raise APIError(400, f"{param} holds {bad}, a lone surrogate, which is not valid Unicode", param) from None
