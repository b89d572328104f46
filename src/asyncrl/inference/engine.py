"""The native inference engine: batched sampling with per-token log-probabilities and live weight updates.

No HTTP here (that is `server.py`). One background thread owns the model, so that nothing else touches
the weights while a forward pass runs. Between two decoding steps it runs the commands other threads
queued (pause, resume, load new weights); then, unless paused, it runs one step. Other threads talk to it
through `generate`, `pause`, `resume` and `update_weights`, which return `concurrent.futures.Future`s.

Batching, first version: the scheduler hands the thread up to `max_batch_size` waiting sequences (one per
sample; a request with n samples is n sequences). They are left-padded and prefilled together — once per
distinct prompt, the KV cache is then copied to its n samples — and decoded step by step with the
model's KV cache; a finished row leaves the batch. When the batch is empty, the next waiting sequences
start, so a new request waits for the current batch to drain. Continuous batching (admitting new rows
into a running batch) is the next step; only `Engine._run` and `Batch` need to change for it.

A weight update lands between two steps: sequences in flight continue with the new weights and every
token records the policy version that produced it.
"""

from __future__ import annotations

import inspect
import logging
import random
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncrl.config.schema import InferenceConfig
from asyncrl.errors import AsyncRLError
from asyncrl.inference.sampling import sample
from asyncrl.loading import load_model, load_tokenizer, resolve_device
from asyncrl.transport.weights import load_state_dict

log = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20


class RequestError(AsyncRLError):
    """A request the engine cannot serve as asked (too long, bad token ids); the caller should fix it."""


class WeightsError(AsyncRLError):
    """New weights could not be loaded; the engine keeps serving the old ones."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # end the sample, like EOS; the stop token is part of the output
    stop: tuple[str, ...] = ()  # end the sample once its decoded text contains one of these
    seed: int | None = None  # sample i draws from a generator seeded with seed + i
    top_logprobs: int = 0  # alternatives recorded per token


@dataclass
class Completion:
    """One sample. `logprobs[t]` = log_softmax(logits / temperature)[token_ids[t]], before top-k/top-p."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    top_logprobs: list[list[tuple[int, float]]]  # per token: (token id, logprob), most likely first
    finish_reason: str  # "stop" (EOS, stop token, stop string) or "length" (max_tokens)


@dataclass(frozen=True)
class EngineStats:
    running_sequences: int
    waiting_sequences: int
    generated_tokens: int
    policy_version: int
    paused: bool


class PendingRequest:
    """A request in the engine: its future resolves once all n samples are finished."""

    def __init__(self, request: GenerationRequest, seeds: list[int]):
        self.request = request
        self.future: Future[list[Completion]] = Future()
        self.sequences = [Sequence(self, index, seed) for index, seed in enumerate(seeds)]
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
    """One sample being generated."""

    request: PendingRequest
    index: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def abandoned(self) -> bool:
        """The caller cancelled the request, or another sample of it failed: no one will read this one."""
        return self.request.future.done()

    def completion(self) -> Completion:
        assert self.finish_reason is not None
        return Completion(self.token_ids, self.logprobs, self.policy_versions, self.top_logprobs, self.finish_reason)


class Scheduler:
    """Decides which waiting sequences run next: first come, first served, up to `max_batch_size`.

    Not thread-safe; the engine holds its lock around every call.
    """

    def __init__(self, max_batch_size: int):
        self.max_batch_size = max_batch_size
        self.waiting: deque[Sequence] = deque()

    def add(self, sequences: list[Sequence]) -> None:
        self.waiting.extend(sequences)

    def next_batch(self) -> list[Sequence]:
        batch: list[Sequence] = []
        while self.waiting and len(batch) < self.max_batch_size:
            sequence = self.waiting.popleft()
            if not sequence.abandoned:
                batch.append(sequence)
        return batch

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


@dataclass
class Batch:
    """The rows being decoded together and their per-row state. Row i of every tensor is `sequences[i]`."""

    sequences: list[Sequence]
    cache: Any  # the model's KV cache (transformers Cache), one row per sequence
    attention_mask: torch.Tensor  # [B, T]: 0 on the left padding, 1 on every real token in the cache
    next_positions: torch.Tensor  # [B]: position id of the token each row feeds next
    temperature: torch.Tensor  # [B]
    top_p: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B]
    generators: list[torch.Generator]
    last_tokens: torch.Tensor | None = None  # [B]: the tokens sampled last, fed in the next step

    @property
    def num_top(self) -> int:
        return max(sequence.request.request.top_logprobs for sequence in self.sequences)

    def keep(self, rows: list[int]) -> None:
        """Drop every row not in `rows` (finished or abandoned), from the KV cache too."""
        index = torch.tensor(rows, dtype=torch.long, device=self.attention_mask.device)
        self.sequences = [self.sequences[row] for row in rows]
        self.generators = [self.generators[row] for row in rows]
        self.cache.batch_select_indices(index)
        for name in ("attention_mask", "next_positions", "temperature", "top_p", "top_k", "last_tokens"):
            setattr(self, name, getattr(self, name)[index])


class Engine:
    """Holds the policy and serves generation requests from one background decoding thread."""

    def __init__(self, cfg: InferenceConfig):
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.tokenizer = load_tokenizer(cfg.model.name)
        self.model = load_model(cfg.model, self.device)
        self.model.eval()
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # transformers 5 renamed the forward's `past_key_values` to `cache`; accept both.
        parameters = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in parameters

        self.scheduler = Scheduler(cfg.max_batch_size)
        self.policy_version = 0
        self.generated_tokens = 0
        self._seeds = random.Random(cfg.seed)  # seeds of requests that bring none
        self._paused = False
        self._stopping = False
        self._batch: Batch | None = None
        self._commands: list[tuple[Callable[[], Any], Future]] = []
        self._wakeup = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="asyncrl-decode", daemon=True)
        self._thread.start()

    # ---- called from other threads ----

    def generate(self, request: GenerationRequest) -> Future[list[Completion]]:
        """Queue a request; the future resolves to its n completions. Raises RequestError at once when the
        request cannot be served. Cancelling the future drops the request's remaining work."""
        self._validate(request)
        with self._wakeup:
            seeds = [
                request.seed + index if request.seed is not None else self._seeds.getrandbits(63)
                for index in range(request.n)
            ]
            pending = PendingRequest(request, seeds)
            self.scheduler.add(pending.sequences)
            self._wakeup.notify()
        return pending.future

    def pause(self) -> Future[None]:
        """No decoding step runs until `resume`; requests keep queueing. Resolves once no step is in flight."""
        return self._command(lambda: setattr(self, "_paused", True))

    def resume(self) -> Future[None]:
        return self._command(lambda: setattr(self, "_paused", False))

    def update_weights(self, path: Path | str, version: int) -> Future[int]:
        """Load a published `weights/step_N` folder between two decoding steps; resolves to the new policy
        version once the weights are live, or to WeightsError (the old weights stay)."""

        def apply() -> int:
            self._load_weights(Path(path))
            self.policy_version = version
            log.info("policy version %d live (from %s)", version, path)
            return version

        return self._command(apply)

    def stats(self) -> EngineStats:
        batch = self._batch
        return EngineStats(
            running_sequences=len(batch.sequences) if batch is not None else 0,
            waiting_sequences=self.scheduler.num_waiting,
            generated_tokens=self.generated_tokens,
            policy_version=self.policy_version,
            paused=self._paused,
        )

    def stop(self) -> None:
        """End the decoding thread; requests still waiting or running fail."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join()
        stopped = AsyncRLError("the inference engine stopped")
        for sequence in [*self.scheduler.waiting, *(self._batch.sequences if self._batch else [])]:
            sequence.request.fail(stopped)
        for _, future in self._commands:
            if future.set_running_or_notify_cancel():
                future.set_exception(stopped)

    def _validate(self, request: GenerationRequest) -> None:
        prompt = len(request.prompt_ids)
        if prompt == 0:
            raise RequestError("the prompt is empty (give at least one token)")
        if prompt + request.max_tokens > self.cfg.seq_len:
            raise RequestError(
                f"prompt ({prompt} tokens) + max_tokens ({request.max_tokens}) = {prompt + request.max_tokens} "
                f"tokens is longer than the server's seq_len ({self.cfg.seq_len}) (shorten the prompt, lower "
                "max_tokens or raise inference.seq_len)"
            )
        bad = [token for token in request.prompt_ids if not 0 <= token < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if any(not text for text in request.stop):
            raise RequestError("stop strings must not be empty")
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")

    def _command(self, action: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._wakeup:
            if self._stopping:
                raise AsyncRLError("the inference engine stopped")
            self._commands.append((action, future))
            self._wakeup.notify()
        return future

    # ---- the decoding thread ----

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wakeup:
                    self._wakeup.wait_for(self._has_work)
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, []
                    starting = self.scheduler.next_batch() if self._batch is None and not commands else []
                for action, future in commands:
                    if not future.set_running_or_notify_cancel():
                        continue
                    try:
                        future.set_result(action())
                    except Exception as error:  # noqa: BLE001 - the caller gets it through the future
                        future.set_exception(error)
                if commands or self._paused:
                    continue
                self._step(starting)

    def _has_work(self) -> bool:
        if self._stopping or self._commands:
            return True
        return not self._paused and (self._batch is not None or self.scheduler.num_waiting > 0)

    def _step(self, starting: list[Sequence]) -> None:
        """Prefill `starting` into a new batch, or run one decoding step of the current batch."""
        sequences = starting if self._batch is None else self._batch.sequences
        if not sequences:
            return
        try:
            if self._batch is None:
                self._batch = self._prefill(starting)
            else:
                self._decode(self._batch)
        except Exception as error:
            log.exception("decoding step failed; failing the %d sequences of the batch", len(sequences))
            for sequence in sequences:
                sequence.request.fail(AsyncRLError(f"generation failed: {type(error).__name__}: {error}"))
            self._batch = None
            return
        if not self._batch.sequences:
            self._batch = None

    def _prefill(self, sequences: list[Sequence]) -> Batch:
        # The n samples of one request share a prompt: run it once, then copy its KV cache to each row.
        requests = list(dict.fromkeys(sequence.request for sequence in sequences))
        prompts = [request.request.prompt_ids for request in requests]
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.tensor(
            [[self.pad_token_id] * (width - len(prompt)) + prompt for prompt in prompts], device=self.device
        )
        mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, cache = self._forward(input_ids, mask, positions, cache=None)

        slot = {request: i for i, request in enumerate(requests)}
        rows = torch.tensor([slot[sequence.request] for sequence in sequences], device=self.device)
        if len(requests) != len(sequences):
            cache.batch_select_indices(rows)
        params = [sequence.request.request for sequence in sequences]
        batch = Batch(
            sequences=list(sequences),
            cache=cache,
            attention_mask=mask[rows],
            next_positions=mask.sum(-1)[rows],
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=self.device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=self.device),
            generators=[torch.Generator(self.device).manual_seed(sequence.seed) for sequence in sequences],
        )
        self._append_next_tokens(batch, logits[rows])
        return batch

    def _decode(self, batch: Batch) -> None:
        mask = torch.cat([batch.attention_mask, batch.attention_mask.new_ones(len(batch.sequences), 1)], dim=-1)
        logits, batch.cache = self._forward(
            batch.last_tokens[:, None], mask, batch.next_positions[:, None], batch.cache
        )
        batch.attention_mask = mask
        batch.next_positions = batch.next_positions + 1
        self._append_next_tokens(batch, logits)

    def _forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache: Any
    ) -> tuple[torch.Tensor, Any]:
        """Logits of the last position [B, V] and the updated KV cache. Positions and mask are explicit, so
        left padding never shifts a row's positions."""
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": True}
        if cache is not None:
            kwargs[self._cache_arg] = cache
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        output = self.model(input_ids=input_ids, **kwargs)
        new_cache = output.get("cache")
        if new_cache is None:
            new_cache = output.get("past_key_values")
        return output.logits[:, -1], new_cache

    def _append_next_tokens(self, batch: Batch, logits: torch.Tensor) -> None:
        """Sample one token per row, record it, and drop the rows that are finished."""
        sampled = sample(logits, batch.temperature, batch.top_p, batch.top_k, batch.generators, batch.num_top)
        token_ids = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist()
        top_ids, top_logprobs = sampled.top_ids.tolist(), sampled.top_logprobs.tolist()
        keep, finished = [], []
        for row, sequence in enumerate(batch.sequences):
            if sequence.abandoned:
                continue
            request = sequence.request.request
            token = token_ids[row]
            sequence.token_ids.append(token)
            sequence.logprobs.append(logprobs[row])
            sequence.policy_versions.append(self.policy_version)
            if request.top_logprobs:
                top = zip(top_ids[row][: request.top_logprobs], top_logprobs[row][: request.top_logprobs])
                sequence.top_logprobs.append(list(top))
            self.generated_tokens += 1
            sequence.finish_reason = self._finish_reason(sequence, token)
            (keep if sequence.finish_reason is None else finished).append(row)
        batch.last_tokens = sampled.token_ids
        done = [batch.sequences[row] for row in finished]
        if len(keep) < len(batch.sequences):
            batch.keep(keep)
        for sequence in done:
            sequence.request.sequence_finished()

    def _finish_reason(self, sequence: Sequence, token: int) -> str | None:
        request = sequence.request.request
        if token in self.eos_token_ids or token in request.stop_token_ids:
            return "stop"
        if request.stop and self._ends_with_stop_string(sequence.token_ids, request.stop):
            return "stop"
        if len(sequence.token_ids) >= request.max_tokens:
            return "length"
        return None

    def _ends_with_stop_string(self, token_ids: list[int], stop: tuple[str, ...]) -> bool:
        # A match can only involve the newest token (an older one would have stopped the sample already),
        # so decoding a short tail is enough: every token is at least one byte, a character at most four.
        tail = token_ids[-(4 * max(len(text) for text in stop) + 4) :]
        text = self.tokenizer.decode(tail, skip_special_tokens=True)
        return any(s in text for s in stop)

    def _load_weights(self, path: Path) -> None:
        """Copy a published state dict into the live model, after checking it fits: a bad folder must leave
        the old weights untouched, so nothing is copied until every key and shape is known to match."""
        try:
            state = load_state_dict(path)
        except FileNotFoundError as error:
            raise WeightsError(f"{error} (give the path of a published weights/step_N folder)") from None
        except Exception as error:
            raise WeightsError(f"weights in '{path}' could not be read: {error}") from None
        current = self.model.state_dict()
        # The publisher leaves out tensors that share storage with another (tied lm_head / embeddings);
        # such a key may be missing as long as one tensor of its storage is present.
        storage = {name: tensor.untyped_storage().data_ptr() for name, tensor in current.items()}
        present = {storage[name] for name in state if name in storage}
        missing = [name for name in current if name not in state and storage[name] not in present]
        unexpected = [name for name in state if name not in current]
        reshaped = [name for name in state if name in current and state[name].shape != current[name].shape]
        problems = [
            f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
            for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", reshaped))
            if names
        ]
        if problems:
            raise WeightsError(
                f"weights in '{path}' do not fit the served model {self.cfg.model.name} ({'; '.join(problems)})"
            )
        self.model.load_state_dict(state, strict=False)


def _eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends a sample: the tokenizer's EOS, ChatML's <|im_end|>, the generation config's EOS."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    generation = getattr(model, "generation_config", None)
    configured = getattr(generation, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return frozenset(i for i in ids if i is not None)
