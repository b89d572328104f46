"""A generation request and its samples, as the engine tracks them from arrival to completion.

A request asks for `n` samples of one prompt; each sample is a `Sequence` that the scheduler places in a
KV-cache slot of its own. The request's future resolves once every sample has finished.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import numpy as np

from asyncrl.errors import AsyncRLError
from asyncrl.transport.routing import unrecorded

MAX_TOP_LOGPROBS = 20
INT64 = range(-(2**63), 2**63)  # what a sampling integer must fit: the engine holds them in int64 tensors


class RequestError(AsyncRLError):
    """A request the engine cannot serve as asked (too long, bad token ids); the caller should fix it."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0 = no limit
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # end the sample, like EOS; the stop token is part of the output
    stop: tuple[str, ...] = ()  # end the sample once its decoded text contains one of these
    seed: int | None = None  # sample i draws from a generator seeded with seed + i
    top_logprobs: int = 0  # alternatives recorded per token
    ignore_eos: bool = False  # sample on past EOS until max_tokens (benchmarks); stop tokens still stop
    # Changes to the logits before the temperature, in vLLM's order (see sampling.LogitAdjustments):
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> added to its logit
    repetition_penalty: float = 1.0  # tokens of the prompt or the output: logit / it if > 0, else logit x it
    frequency_penalty: float = 0.0  # minus this x the times the token was generated
    presence_penalty: float = 0.0  # minus this if the token was generated at all
    return_routed_experts: bool = False  # MoE models: record the experts every token was routed to (router replay)


def check_request(request: GenerationRequest, seq_len: int, vocab_size: int) -> None:
    """Raise RequestError naming what is wrong with `request`, for a server of `seq_len` tokens and a vocabulary
    of `vocab_size`. A request that passes cannot fail the decoding batch it joins."""
    prompt = len(request.prompt_ids)
    if prompt == 0:
        raise RequestError("the prompt is empty (give at least one token)")
    if request.max_tokens < 1:
        raise RequestError("max_tokens must be at least 1")
    if prompt + request.max_tokens > seq_len:
        raise RequestError(
            f"prompt ({prompt} tokens) + max_tokens ({request.max_tokens}) = {prompt + request.max_tokens} "
            f"tokens is longer than the server's seq_len ({seq_len}) (shorten the prompt, lower max_tokens or "
            "raise inference.seq_len)"
        )
    bad = next((token for token in request.prompt_ids if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    # NaN fails every comparison, so each bound below refuses it too.
    for ok, problem in (
        (request.n >= 1, "n must be at least 1"),
        (0 <= request.temperature < math.inf, "temperature must be a finite number >= 0 (0 is greedy)"),
        (0 < request.top_p <= 1, "top_p must be in (0, 1]"),
        (0 <= request.top_k < 2**63, "top_k must be >= 0 and below 2**63 (0 is no limit)"),
        (0 <= request.min_p <= 1, "min_p must be in [0, 1] (0 is no limit)"),
        (all(request.stop), "stop strings must not be empty"),
        (0 <= request.top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}"),
        (request.seed is None or request.seed in INT64, "seed must fit in 64 bits"),
        (-2 <= request.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
        (-2 <= request.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
        (0 < request.repetition_penalty < math.inf, "repetition_penalty must be a finite number > 0 (1 is none)"),
        (all(math.isfinite(bias) for bias in request.logit_bias.values()), "logit_bias values must be finite"),
    ):
        if not ok:
            raise RequestError(problem)
    bad = next((token for token in request.logit_bias if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise RequestError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})")


@dataclass
class Completion:
    """One sample. `logprobs[t]` = log_softmax(logits / temperature)[token_ids[t]], before top-k/top-p/min-p."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    top_logprobs: list[list[tuple[int, float]]]  # per token: (token id, logprob), most likely first
    finish_reason: str  # "stop" (EOS, stop token, stop string) or "length" (max_tokens)
    # With `return_routed_experts`: int16 [tokens, MoE layers, k] of the prompt and of this sample's tokens
    # (transport/routing.py; -1 on the last sampled token, which was never fed through the model).
    prompt_routed_experts: np.ndarray | None = None
    routed_experts: np.ndarray | None = None
    cached_tokens: int = 0  # prompt tokens its prefill read from the prefix cache instead of computing them


TokenCallback = Callable[[int, int, float, list[tuple[int, float]], int, str | None], None]
"""`on_token(sample_index, token_id, logprob, top_logprobs, policy_version, finish_reason)`: called from the
decoding thread right after a token is appended (finish_reason is set on a sample's last token). Streaming
uses it; it must return quickly and never raise."""


class PendingRequest:
    """A request in the engine: its future resolves once all n samples are finished."""

    def __init__(self, request: GenerationRequest, seeds: list[int], on_token: TokenCallback | None = None):
        self.request = request
        self.stop_token_ids = frozenset(request.stop_token_ids)  # checked at every token: a set, whatever its size
        self.on_token = on_token
        self.future: Future[list[Completion]] = Future()
        self.sequences = [Sequence(self, index, seed) for index, seed in enumerate(seeds)]
        self.started = False  # a sample of it has been admitted (its prompt tokens are counted then)
        self.prompt_routed_experts: np.ndarray | None = None  # [prompt, MoE layers, k], from its first prefill
        self._unfinished = len(seeds)

    def sequence_finished(self) -> None:
        self._unfinished -= 1
        if self._unfinished == 0:
            self._resolve(lambda: self.future.set_result([sequence.completion() for sequence in self.sequences]))

    def fail(self, error: BaseException) -> None:
        self._resolve(lambda: self.future.set_exception(error))

    def _resolve(self, settle: Callable[[], None]) -> None:
        # The caller may cancel the future from its own thread at any moment; then nobody is waiting.
        try:
            settle()
        except InvalidStateError:
            pass


@dataclass(eq=False)
class Sequence:
    """One sample being generated. Its random draws come from its own generator, seeded per sample, so a
    seeded request samples the same tokens whatever else shares the batch."""

    request: PendingRequest
    index: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    routed_experts: list[np.ndarray] = field(default_factory=list)  # per fed token: [MoE layers, k]
    # The prefix cache (paged layout): prompt tokens its first prefill read from it; positions its next
    # prefill reads from it; the scheduler's cache epoch at admission (its keys and values are the weights' of
    # that epoch).
    cached_tokens: int = 0
    prefill_start: int = 0
    cache_epoch: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    @property
    def params(self) -> GenerationRequest:
        return self.request.request

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens; all but the newest are in the KV cache."""
        return len(self.request.request.prompt_ids) + len(self.token_ids)

    @property
    def abandoned(self) -> bool:
        """The caller cancelled the request, or another sample of it failed: no one will read this one."""
        return self.request.future.done()

    def completion(self) -> Completion:
        assert self.finish_reason is not None
        completion = Completion(
            self.token_ids,
            self.logprobs,
            self.policy_versions,
            self.top_logprobs,
            self.finish_reason,
            cached_tokens=self.cached_tokens,
        )
        prompt_routed = self.request.prompt_routed_experts
        if self.params.return_routed_experts and prompt_routed is not None:
            fed = np.stack(self.routed_experts) if self.routed_experts else prompt_routed[:0]
            completion.prompt_routed_experts = prompt_routed
            completion.routed_experts = np.concatenate([fed, unrecorded(len(self.token_ids) - len(fed), prompt_routed)])
        return completion
