"""Tokens in, tokens out: `/v1/generate` (ours: what the orchestrator and the trainer's logprobs rely on) and
`/inference/v1/generate` (vLLM's token route, which verifiers' train client speaks). See docs/inference.md."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from asyncrl.config.schema import InferenceConfig
from asyncrl.inference.api.api_errors import APIError
from asyncrl.inference.api.bodies import parsed_body
from asyncrl.inference.api.disconnect import unless_disconnected
from asyncrl.inference.api.limits import admit
from asyncrl.inference.api.prompts import PromptWorkers
from asyncrl.inference.api.protocol import (
    GenerateBody,
    TokenGenerateBody,
    TokenSamplingParams,
    check_model,
    in_thread,
    prompt_cached_tokens,
    stop_strings,
    usage,
)
from asyncrl.inference.api.text import token_id_logprobs
from asyncrl.inference.backends.backend import Backend
from asyncrl.inference.engine.sequence import Completion, GenerationRequest
from asyncrl.transport import routing


def sampling(body: Any) -> dict[str, Any]:
    """The sampling fields every body shares, as GenerationRequest fields."""
    return {
        "n": body.n,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": max(body.top_k, 0),  # vLLM spells "no limit" -1
        "min_p": body.min_p,
        "seed": body.seed,
        "logit_bias": body.logit_bias or {},
        "repetition_penalty": body.repetition_penalty,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "ignore_eos": body.ignore_eos,
    }


def token_routes(backend: Backend, cfg: InferenceConfig, model_name: str, workers: PromptWorkers) -> APIRouter:
    router = APIRouter()
    generate_body = Depends(parsed_body(GenerateBody, workers))
    token_generate_body = Depends(parsed_body(TokenGenerateBody, workers))

    @router.post("/v1/generate", response_model=None)
    async def generate(raw: Request, body: GenerateBody = generate_body) -> JSONResponse:
        request = GenerationRequest(
            prompt_ids=body.prompt_ids,
            max_tokens=body.max_tokens,
            stop_token_ids=tuple(body.stop_token_ids),
            return_routed_experts=body.return_routed_experts,
            **sampling(body),
        )
        admit(cfg, backend.vocab_size, [request])
        completions = await unless_disconnected(raw, backend.generate(request))
        return await in_thread(generate_answer, completions, len(body.prompt_ids))

    @router.post("/inference/v1/generate", response_model=None)
    async def generate_like_vllm(raw: Request, body: TokenGenerateBody = token_generate_body) -> JSONResponse:
        check_model(body.model, model_name)
        if body.stream:
            raise APIError(400, "stream=true is not supported on /inference/v1/generate (send stream=false)", "stream")
        params: TokenSamplingParams = body.sampling_params
        request = GenerationRequest(
            prompt_ids=body.token_ids,
            max_tokens=params.max_tokens or max(cfg.seq_len - len(body.token_ids), 1),
            stop_token_ids=tuple(params.stop_token_ids or ()),
            stop=stop_strings(params.stop),
            top_logprobs=params.logprobs or 0,
            **sampling(params),
        )
        admit(cfg, backend.vocab_size, [request])
        completions = await unless_disconnected(raw, backend.generate(request))
        return await in_thread(token_route_answer, params, completions, len(body.token_ids), model_name)

    return router


def generate_answer(completions: list[Completion], prompt_tokens: int) -> dict:
    """`/v1/generate`'s answer: per choice, its tokens and how many prompt tokens its prefill read from the prefix
    cache; with routed experts (a mixture-of-experts model asked for them), the prompt's once and each choice's
    own, in transport/routing.py's encoding."""
    choices = [
        {
            "token_ids": c.token_ids,
            "logprobs": c.logprobs,
            "policy_versions": c.policy_versions,
            "finish_reason": c.finish_reason,
            "cached_tokens": c.cached_tokens,
        }
        for c in completions
    ]
    answer = {"choices": choices, "prompt_tokens": prompt_tokens}
    if completions and completions[0].routed_experts is not None:
        answer["prompt_routed_experts"] = routing.encode(completions[0].prompt_routed_experts)
        for choice, completion in zip(choices, completions):
            choice["routed_experts"] = routing.encode(completion.routed_experts)
    return answer


def token_route_answer(
    params: TokenSamplingParams, completions: list[Completion], prompt_tokens: int, model_name: str
) -> dict:
    choices = []
    for index, completion in enumerate(completions):
        logprobs = None
        if params.logprobs is not None:
            logprobs = {"content": token_id_logprobs(completion)}
        choices.append(
            {
                "index": index,
                "token_ids": completion.token_ids,
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "policy_versions": completion.policy_versions,
            }
        )
    return {
        "request_id": f"generate-tokens-{uuid.uuid4().hex}",
        "model": model_name,
        "choices": choices,
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in completions), prompt_cached_tokens(completions)),
    }
