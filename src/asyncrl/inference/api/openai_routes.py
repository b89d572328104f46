"""The OpenAI-compatible routes: `/v1/completions` (streaming too), `/v1/models`, and `/v1/chat/completions`
from `chat_routes.py`.

They translate: prompts (or messages) into token ids, then the backend's completions into OpenAI's answer (text
cut at stop strings, logprob entries, usage). Tokenizing and building answers run in worker threads: a long
prompt or a long answer with top logprobs must not hold the event loop, which serves every other client (and
/health).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from asyncrl.config.schema import InferenceConfig
from asyncrl.inference.api.api_errors import APIError
from asyncrl.inference.api.bodies import parsed_body
from asyncrl.inference.api.chat_processes import ChatProcesses
from asyncrl.inference.api.chat_routes import chat_routes
from asyncrl.inference.api.disconnect import unless_disconnected
from asyncrl.inference.api.limits import PromptTextLimit, admit
from asyncrl.inference.api.prompts import PromptTokenizer, PromptWorkers
from asyncrl.inference.api.protocol import (
    CompletionBody,
    OpenAIBody,
    check_model,
    check_supported,
    check_unicode,
    in_thread,
    model_card,
    prompt_cached_tokens,
    stop_strings,
    usage,
)
from asyncrl.inference.api.streaming import StreamPiece, TokenStream, event_stream, usage_chunk
from asyncrl.inference.api.text import TokenText, completion_logprobs, visible_text
from asyncrl.inference.api.token_routes import sampling
from asyncrl.inference.backends.backend import Backend
from asyncrl.inference.engine.sequence import Completion, GenerationRequest

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of seq_len


def openai_routes(
    backend: Backend, cfg: InferenceConfig, model_name: str, workers: PromptWorkers, chat_processes: ChatProcesses
) -> APIRouter:
    router = APIRouter()
    prompt_work = PromptTokenizer(backend.tokenizer, workers, cfg.seq_len)
    completion_body = Depends(parsed_body(CompletionBody, workers, check_supported))
    router.include_router(chat_routes(backend, cfg, model_name, prompt_work, chat_processes))
    tokenizer = backend.tokenizer
    text_limit = PromptTextLimit(tokenizer, cfg.seq_len)
    tokens = TokenText(tokenizer)

    def request_for(body: OpenAIBody, prompt_ids: list[int], max_tokens: int, top_logprobs: int) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            stop=stop_strings(body.stop),
            top_logprobs=top_logprobs,
            **sampling(body),
        )

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(model_name, cfg.seq_len)]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id, model_name)
        return model_card(model_name, cfg.seq_len)

    # ---- completions ----

    async def completion_prompts(body: CompletionBody, max_tokens: int, body_bytes: int) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        await prompt_work.prepare(body_bytes, lambda: check_unicode(prompt, "prompt"))
        for text in prompt:
            if isinstance(text, str):
                text_limit.check(text, "prompt")
        tokenized = []
        for text in prompt:
            if isinstance(text, str):
                tokenized.append(await prompt_work.tokenize(text, body_bytes, max_tokens, special_tokens=True))
            else:
                tokenized.append(list(text))
        return tokenized

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
                sum(len(r.prompt_ids) for r in requests),
                sum(len(c.token_ids) for result in results for c in result),
                sum(prompt_cached_tokens(result) for result in results),
            ),
        }

    @router.post("/v1/completions", response_model=None)
    async def completions(raw: Request, body: CompletionBody = completion_body) -> JSONResponse | StreamingResponse:
        check_model(body.model, model_name)
        max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        prompts = await unless_disconnected(raw, completion_prompts(body, max_tokens, len(await raw.body())))
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

            def final() -> dict | None:
                if body.stream_options is None or not body.stream_options.include_usage:
                    return None
                prompt_tokens = sum(len(ids) for ids in prompts)
                return usage_chunk(completion_id, "text_completion", model_name, prompt_tokens, stream)

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
