"""The native inference engine: continuous batching with per-token log-probabilities and live weight updates.

No HTTP here (that is `api/server.py`). One background thread owns the model, so that nothing else touches
the weights while a forward pass runs. Between two steps it runs the commands other threads queued
(pause, resume, load new weights); then, unless paused, it runs one step:

1. the scheduler admits waiting samples into free KV-cache slots, or free blocks with the paged layout
   (`scheduler.py`);
2. the model runner prefills their prompts, once per request, and the first token of each is sampled
   (the samples of a request then share one copy of the prompt's keys and values in the cache: with the
   Triton decoding attention in the slots layout, `shared_prompts.py`; in the paged layout, by sharing
   blocks, `block_tables.py`); a preempted sample rejoining is prefilled with all it had, and sampled on;
3. one decoding step runs for every sample in the batch (`model_runner.py`, a CUDA graph on GPU); in the
   paged layout, first every sample's next position is made writable, preempting the newest samples when
   blocks run out;
4. tokens are sampled on the device (`sampling.py`), recorded, and finished samples free their slots (or
   blocks).

On a GPU, decoding runs one step ahead of the host: while the batch stays the same, step t+1 is launched
from the tokens step t sampled, still on the device, before the host reads step t's tokens
(`_step_ahead`), so the host's bookkeeping overlaps the device's work instead of leaving it idle. A sample
that finished at step t was decoded once more for nothing; that row is dropped. The step in flight is read
before anything changes the batch or the weights (a command, a sample joining), and no step is launched
ahead when every sample ends with the one in flight. In the paged layout the step ahead needs every
sample's next position writable first, which the host knows without the tokens; when that takes more
blocks than are free, the step in flight is read and the next step preempts as step 3 says.

Other threads talk to it through `generate`, `pause`, `resume` and `update_weights`, which return
`concurrent.futures.Future`s. A weight update lands between two steps: samples in flight continue with the
new weights (their KV cache of earlier tokens stays as the old weights made it) and every token records the
policy version that produced it. Nothing computed under old weights is reused for a new request: without
the prefix cache each request prefills its own prompt (its samples share it only among themselves); with it
(`inference.prefix_cache`, paged layout) a request starts from the blocks that earlier prompts and samples
left with the same leading tokens, and every weight update drops them all (`Scheduler.forget_prefixes`).
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from asyncrl.config.schema import InferenceConfig
from asyncrl.errors import AsyncRLError
from asyncrl.inference.engine.block_pool import BlockPool
from asyncrl.inference.engine.block_tables import BlockTables
from asyncrl.inference.engine.kv_cache import GIB, KVCache, bytes_per_token, slots_for_budget
from asyncrl.inference.engine.model_runner import ModelRunner, check_supported
from asyncrl.inference.engine.paged_cache import PagedKVCache, blocks_for_budget
from asyncrl.inference.engine.routed import RoutedCopy
from asyncrl.inference.engine.sampling import HostCopy, SampledTokens, SamplingBatch, sample, sample_fused
from asyncrl.inference.engine.scheduler import Scheduler
from asyncrl.inference.engine.sequence import (
    MAX_TOP_LOGPROBS,
    Completion,
    GenerationRequest,
    PendingRequest,
    RequestError,
    Sequence,
    TokenCallback,
    check_request,
)
from asyncrl.inference.engine.shared_prompts import SharedPrompts
from asyncrl.inference.kernels import sampling_kernel
from asyncrl.loading import DTYPES, check_model_name, load_tokenizer, resolve_device
from asyncrl.models.checkpoint import from_config, in_memory_state_dict, load_native
from asyncrl.step_profiler import StepProfiler
from asyncrl.transport.weights import load_state_dict

__all__ = [
    "MAX_TOP_LOGPROBS",
    "Completion",
    "Engine",
    "EngineStats",
    "GenerationRequest",
    "RequestError",
    "TokenCallback",
    "WeightsError",
]

log = logging.getLogger(__name__)

MAX_PREFILL_TOKENS = 16384  # prompt rows x longest prompt in one prefill; bounds its activation memory
DEFAULT_CPU_KV_CACHE_GB = 2.0
DEFAULT_GPU_KV_CACHE_FRACTION = 0.8  # of the memory free once the model is loaded
NAN_LOGITS = "generation failed: the model gave NaN logits (are its weights finite? is bfloat16 overflowing?)"


class WeightsError(AsyncRLError):
    """New weights could not be loaded; the engine keeps serving the old ones."""


@dataclass(frozen=True)
class EngineStats:
    running_sequences: int
    waiting_sequences: int
    running_requests: int  # requests with a sample in the batch
    waiting_requests: int  # requests with samples waiting and none in the batch
    kv_cache_used_tokens: int  # tokens held by running samples
    kv_cache_total_tokens: int  # slots x seq_len, or blocks x block size
    kv_cache_blocks_used: int  # paged layout: blocks held by running samples (a shared one once); slots: 0
    kv_cache_blocks_total: int  # paged layout: blocks in the pool; slots: 0
    preemptions: int  # since start: samples whose blocks were taken back, to be recomputed (paged layout)
    prefix_cache_hit_tokens: int  # since start: prefill positions read from the prefix cache, not computed
    prefix_cache_blocks_cached: int  # blocks the prefix cache keeps that no running sample holds (counted free)
    generated_tokens: int  # since start
    prompt_tokens: int  # since start, once per request
    policy_version: int
    paused: bool


@dataclass
class InflightStep:
    """A step whose tokens are sampled (or being sampled) on the device and not yet read by the host."""

    sequences: list[Sequence]  # row i's sample
    version: int  # the scheduler's version at launch: which batch it decoded
    context: int  # the longest context it attended (its largest position + 1)
    sampled: SampledTokens
    host: HostCopy
    routed: RoutedCopy | None = None  # the experts each row's input token went to, where a row asked for them


class Engine:
    """Holds the policy and serves generation requests from one background decoding thread."""

    def __init__(self, cfg: InferenceConfig):
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda":
            # Triton launches on the current device: the warm-up below runs in this thread, which starts on
            # cuda:0, and a server on another GPU would fail there ("cannot be accessed from Triton").
            torch.cuda.set_device(self.device)
        self.tokenizer = load_tokenizer(cfg.model.name)
        check_model_name(cfg.model.name)
        config = AutoConfig.from_pretrained(cfg.model.name)
        check_supported(config)
        if cfg.load_format == "dummy":
            torch.manual_seed(cfg.seed)
            self.model = from_config(config, self.device, DTYPES[cfg.model.dtype])
        else:
            self.model = load_native(cfg.model.name, self.device, DTYPES[cfg.model.dtype])
        self.model.eval()
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)

        self.paged = cfg.kv_cache_layout == "paged"
        self.cache = self._allocate_cache()
        compile_decoding = cfg.compile and self.device.type == "cuda"
        self.runner = ModelRunner(
            self.model,
            self.cache,
            cfg.cuda_graphs,
            compile=compile_decoding,
            attention=cfg.decode_attention,
            share_prompts=cfg.share_prompts and not self.paged,  # the paged layout shares blocks instead
            moe_kernel=cfg.moe_kernel,
        )
        # Which slot holds each shared prompt; None where every sample holds its own copy, or blocks are shared.
        self.shared_prompts = SharedPrompts() if self.runner.shares_prompts else None
        self._prefix_rows: tuple[int, tuple[list[int], list[int]]] | None = None  # by scheduler version
        self.runner.warm_up()
        self.sampling_kernels = (
            self.device.type == "cuda" and sampling_kernel.AVAILABLE and self._sampling_kernels_work()
        )
        blocks = BlockTables(BlockPool(self.cache.num_blocks), self.cache.block_size) if self.paged else None
        self.scheduler = Scheduler(
            self.cache.max_sequences, MAX_PREFILL_TOKENS, blocks, prefix_cache=self.paged and cfg.prefix_cache
        )
        self.policy_version = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self._seeds = random.Random(cfg.seed)  # seeds of requests that bring none
        self._sampling: tuple[int, SamplingBatch] | None = None  # the running batch's, by scheduler version
        self._inflight: InflightStep | None = None  # the decoding step launched last, not yet read
        # Decoding one step ahead overlaps the host's work with the device's: a GPU gains, a CPU (which runs
        # the step on the calling thread) would only decode rows of finished samples for nothing.
        self.decode_ahead = self.device.type == "cuda"
        self._paused = False
        self._stopping = False
        self._commands: list[tuple[Callable[[], Any], Future]] = []
        self._wakeup = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="asyncrl-decode", daemon=True)
        self._thread.start()

    def _sampling_kernels_work(self) -> bool:
        """Compile the Triton sampler now (one row), so that the first request does not wait for it; where
        the toolchain cannot build it, sample in torch instead (slower, the same draws)."""
        logits = torch.zeros(1, self.vocab_size, dtype=self.cache.keys.dtype, device=self.device)
        params = SamplingBatch.of([GenerationRequest([0])], self.device)
        uniforms = torch.zeros(1, dtype=torch.float64, device=self.device)
        try:
            with torch.inference_mode():
                sample_fused(logits, params, uniforms).to_host().read()
        except Exception as error:  # noqa: BLE001 - any failure to build means: use torch's sampler
            first_line = (str(error).strip().splitlines() or ["no message"])[0]
            log.warning(
                "the Triton sampler could not be built (%s: %s); sampling in torch", type(error).__name__, first_line
            )
            return False
        return True

    def _allocate_cache(self) -> KVCache | PagedKVCache:
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = self.model.get_input_embeddings().weight.dtype
        shape = (config.num_hidden_layers, config.num_key_value_heads, head_dim)
        token_bytes = bytes_per_token(*shape, dtype)
        if self.cfg.kv_cache_gb is not None:
            budget = self.cfg.kv_cache_gb * GIB
        else:
            wanted = self.cfg.max_batch_size * self.cfg.seq_len * token_bytes
            if self.device.type == "cuda":
                available = DEFAULT_GPU_KV_CACHE_FRACTION * torch.cuda.mem_get_info(self.device)[0]
            else:
                available = DEFAULT_CPU_KV_CACHE_GB * GIB
            budget = min(wanted, available)
        if self.paged:
            block_size = self.cfg.kv_block_size
            blocks = blocks_for_budget(budget, block_size, token_bytes, self.cfg.seq_len)
            log.info(
                "KV cache: %d blocks of %d tokens (%.2f GiB), paged",
                blocks,
                block_size,
                blocks * block_size * token_bytes / GIB,
            )
            return PagedKVCache(
                *shape[:2], head_dim, blocks, block_size, self.cfg.seq_len, self.cfg.max_batch_size, dtype, self.device
            )
        slots = slots_for_budget(budget, self.cfg.seq_len, token_bytes, self.cfg.max_batch_size)
        size = slots * self.cfg.seq_len * token_bytes / GIB
        log.info("KV cache: %d slots of %d tokens (%.2f GiB)", slots, self.cfg.seq_len, size)
        return KVCache(*shape[:2], head_dim, slots, self.cfg.seq_len, dtype, self.device)

    # ---- called from other threads ----

    def generate(self, request: GenerationRequest, on_token: TokenCallback | None = None) -> Future[list[Completion]]:
        """Queue a request; the future resolves to its n completions. Raises RequestError at once when the
        request cannot be served. Cancelling the future drops the request's remaining work. `on_token` sees
        every token as it is sampled (see TokenCallback)."""
        check_request(request, self.cfg.seq_len, self.vocab_size)
        with self._wakeup:
            seeds = [
                request.seed + index if request.seed is not None else self._seeds.getrandbits(63)
                for index in range(request.n)
            ]
            pending = PendingRequest(request, seeds, on_token)
            self.scheduler.add(pending.sequences)
            self._wakeup.notify()
        pending.future.add_done_callback(self._drop_if_cancelled)
        return pending.future

    def _drop_if_cancelled(self, future: Future) -> None:
        """A cancelled request leaves at once, paused or not: its waiting samples now, its running ones between
        two steps, so that nothing is decoded for a caller who left, nor holds a KV-cache slot."""
        if not future.cancelled():
            return
        with self._wakeup:
            self.scheduler.drop_abandoned()
            if not self._stopping and any(sequence.abandoned for sequence in self.scheduler.running):
                self._commands.append((self._release_abandoned, Future()))
            self._wakeup.notify()

    def pause(self) -> Future[None]:
        """No step runs until `resume`; requests keep queueing. Resolves once no step is in flight."""
        return self._command(lambda: setattr(self, "_paused", True))

    def resume(self) -> Future[None]:
        return self._command(lambda: setattr(self, "_paused", False))

    def update_weights(self, source: Path | str | Mapping[str, torch.Tensor], version: int) -> Future[int]:
        """Load new weights between two steps: `source` is a published `weights/step_N` folder or a state
        dict {name: tensor} (e.g. received by broadcast). Resolves to the new policy version once the weights
        are live, or to WeightsError (the old weights stay)."""

        def apply() -> int:
            try:
                self._load_weights(source)
            finally:  # keys and values of the old weights are stale (a failed load changes none: harmless)
                with self._wakeup:
                    self.scheduler.forget_prefixes()
            self.policy_version = version
            origin = "a state dict" if isinstance(source, Mapping) else source
            log.info("policy version %d live (from %s)", version, origin)
            self._profiler.step()
            return version

        return self._command(apply)

    def stats(self) -> EngineStats:
        with self._wakeup:
            running, waiting = list(self.scheduler.running), list(self.scheduler.waiting)
            blocks_used = self.scheduler.blocks.pool.num_used if self.paged else 0
            blocks_cached = self.scheduler.blocks.pool.num_cached if self.paged else 0
        running_requests = {sequence.request for sequence in running}
        return EngineStats(
            running_sequences=len(running),
            waiting_sequences=len(waiting),
            running_requests=len(running_requests),
            waiting_requests=len({sequence.request for sequence in waiting} - running_requests),
            kv_cache_used_tokens=sum(sequence.num_tokens for sequence in running),
            kv_cache_total_tokens=self.cache.total_tokens,
            kv_cache_blocks_used=blocks_used,
            kv_cache_blocks_total=self.cache.num_blocks if self.paged else 0,
            preemptions=self.scheduler.preemptions,
            prefix_cache_hit_tokens=self.scheduler.prefix_hit_tokens,
            prefix_cache_blocks_cached=blocks_cached,
            generated_tokens=self.generated_tokens,
            prompt_tokens=self.prompt_tokens,
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
        for sequence in [*self.scheduler.waiting, *self.scheduler.running]:
            sequence.request.fail(stopped)
        for _, future in self._commands:
            if future.set_running_or_notify_cancel():
                future.set_exception(stopped)

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
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread starts on cuda:0
        # Started, stepped and stopped on this thread: its steps are the weight updates it applies.
        name = f"inference_{self.cfg.port}" if self.cfg.port else "inference"
        self._profiler = StepProfiler(self.cfg.profile, name, self.device.type)
        try:
            self._loop()
        finally:
            self._profiler.stop()

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wakeup:
                    self._wakeup.wait_for(self._has_work)
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, []
                    ahead = self._inflight is not None and not commands and not self._paused and self._steady()
                    idle = commands or self._paused or self._inflight is not None
                    admitted = [] if idle else self.scheduler.admit()
                if self._inflight is not None and not ahead:
                    # Something may change the batch or the weights: first read the step in flight.
                    self._guarded(self._drain)
                    if not commands:
                        continue
                for action, future in commands:
                    if not future.set_running_or_notify_cancel():
                        continue
                    try:
                        future.set_result(action())
                    except Exception as error:  # noqa: BLE001 - the caller gets it through the future
                        future.set_exception(error)
                if commands or self._paused:
                    continue
                if ahead:
                    self._guarded(self._step_ahead)
                else:
                    self._guarded(self._step, admitted)

    def _has_work(self) -> bool:
        if self._stopping or self._commands or self._inflight is not None:
            return True
        return not self._paused and (bool(self.scheduler.running) or self.scheduler.num_waiting > 0)

    def _steady(self) -> bool:
        """The batch of the step in flight is still the running batch, no waiting sample could join it, and
        not every sample ends with the step in flight (reaching max_tokens): the next step can be launched
        from the device before the host reads this one, and is not known to be wasted."""
        if not self.decode_ahead or self._inflight.version != self.scheduler.version:
            return False
        running = self.scheduler.running
        if self.scheduler.can_admit():
            return False
        return not all(len(sequence.token_ids) + 1 >= sequence.params.max_tokens for sequence in running)

    def _guarded(self, work: Callable[..., None], *args: Any) -> None:
        """Run a step; if it fails, fail the samples of the batch (not the engine)."""
        try:
            work(*args)
        except Exception as error:
            self._inflight = None
            with self._wakeup:
                failed = self.scheduler.clear()
            if self.shared_prompts is not None:
                self.shared_prompts.clear()
            log.exception("generation step failed; failing the %d samples of the batch", len(failed))
            for sequence in failed:
                sequence.request.fail(AsyncRLError(f"generation failed: {type(error).__name__}: {error}"))

    def _step(self, admitted: list[Sequence]) -> None:
        """Prefill the admitted samples, then launch one decoding step of the whole batch."""
        if admitted:
            self._prefill(admitted)
        if self.paged:
            self._decode_paged()
            return
        running = self.scheduler.running
        if running:
            tokens = [sequence.token_ids[-1] for sequence in running]
            positions = [sequence.num_tokens - 1 for sequence in running]
            logits = self.runner.decode(tokens, positions, *self._running_prefixes())
            self._inflight = self._launch(
                list(running), logits, self._running_sampling(), max(positions) + 1, self._routed(running)
            )

    def _decode_paged(self) -> None:
        """The decoding step of the paged layout: every running sample's next position made writable (blocks
        copied where samples stop sharing one; the newest samples preempted where blocks ran out), then one
        step through the block tables."""
        with self._wakeup:
            copies, preempted = self.scheduler.reserve()
        for copy in copies:
            self.cache.copy_block(copy.source, copy.target)
        if preempted:
            log.debug("%d samples preempted (KV-cache blocks ran out); they are recomputed later", len(preempted))
        running = self.scheduler.running
        if not running:
            return
        tokens = [sequence.token_ids[-1] for sequence in running]
        positions = [sequence.num_tokens - 1 for sequence in running]
        tables = [self.scheduler.blocks.array(sequence) for sequence in running]
        logits = self.runner.decode_paged(tokens, positions, tables)
        self._inflight = self._launch(
            list(running), logits, self._running_sampling(), max(positions) + 1, self._routed(running)
        )

    def _step_ahead(self) -> None:
        """Launch the next decoding step from the tokens the step in flight sampled (still on the device),
        then read that step on the host while the new one runs."""
        previous = self._inflight
        if self.paged:
            logits = self._decode_paged_ahead(previous)
            if logits is None:  # blocks are short: read the step in flight; the next step decides whom to preempt
                self._drain()
                return
        else:
            logits = self.runner.decode_next(previous.sampled.token_ids, previous.context + 1)
        self._take_inflight()
        routed = self._routed(previous.sequences)
        self._inflight = self._launch(
            previous.sequences, logits, self._running_sampling(), previous.context + 1, routed
        )
        self._finish(previous)

    def _decode_paged_ahead(self, previous: InflightStep) -> torch.Tensor | None:
        """The paged layout's step ahead: each sample's position after its newest token made writable first
        (its block tables and written places come from the host, which knows every position without the
        tokens), then the step; None, having launched nothing, where the free blocks do not hold them all."""
        with self._wakeup:
            copies = self.scheduler.reserve_ahead()
        if copies is None:
            return None
        for copy in copies:
            self.cache.copy_block(copy.source, copy.target)
        positions = [sequence.num_tokens for sequence in previous.sequences]
        tables = [self.scheduler.blocks.array(sequence) for sequence in previous.sequences]
        return self.runner.decode_paged(previous.sampled.token_ids, positions, tables)

    def _drain(self) -> None:
        self._finish(self._take_inflight())

    def _take_inflight(self) -> InflightStep:
        step, self._inflight = self._inflight, None
        return step

    def _prefill(self, admitted: list[Sequence]) -> None:
        # The samples of one request admitted together share its prompt: it runs once, its keys and
        # values go to each sample's slot (or to the blocks they share). A preempted sample rejoining
        # (paged layout) is prefilled alone with its prompt and all its tokens but the newest, which the
        # next decoding step feeds: its random draws go on where they stopped, so it samples as if it had
        # never left. With the prefix cache, each prefill row computes only the positions from its
        # `prefill_start` on (the first ones are in cached blocks of its table already).
        recomputed = [sequence for sequence in admitted if sequence.token_ids]
        fresh = [sequence for sequence in admitted if not sequence.token_ids]
        requests = list(dict.fromkeys(sequence.request for sequence in fresh))
        row = {request: index for index, request in enumerate(requests)}
        rows = [row[sequence.request] for sequence in fresh]
        for request in requests:
            if not request.started:
                request.started = True
                self.prompt_tokens += len(request.request.prompt_ids)
        prompts = [request.request.prompt_ids for request in requests]
        wants_routing = [r.request.return_routed_experts and r.prompt_routed_experts is None for r in requests]
        routed = [] if self.runner.moe_index and any(wants_routing) else None
        if self.paged:
            # A request's first sample admitted now holds the blocks all of them share.
            first = {}
            for sequence in fresh:
                first.setdefault(sequence.request, sequence)
            owners = [first[request] for request in requests] + recomputed
            tables = [self.scheduler.blocks.table(owner) for owner in owners]
            prompts += [sequence.params.prompt_ids + sequence.token_ids[:-1] for sequence in recomputed]
            starts = [owner.prefill_start for owner in owners]
            logits = self.runner.prefill_paged(prompts, tables, routed_out=routed, starts=starts)
            with self._wakeup:
                self.scheduler.register_prefilled(owners)
        else:
            first_slot = len(self.scheduler.running) - len(admitted)
            holders = None
            if self.shared_prompts is not None:
                holding = set(self.shared_prompts.admit(admitted))
                holders = [sequence in holding for sequence in admitted]
            logits = self.runner.prefill(prompts, rows, first_slot, holders, routed_out=routed)
        for request, wants, prompt_routed in zip(requests, wants_routing, routed or ()):
            if wants:
                request.prompt_routed_experts = prompt_routed.cpu().numpy()
        if not fresh:
            return
        if rows != list(range(len(logits))):
            logits = logits[torch.tensor(rows, device=logits.device)]
        params = self._sampling_of(fresh)
        self._finish(self._launch(fresh, logits, params, context=0))

    def _running_prefixes(self) -> tuple[list[int] | None, list[int] | None]:
        """Per running row: the slot holding its prompt and how many positions to read there (`decode`)."""
        if self.shared_prompts is None:
            return None, None
        version = self.scheduler.version
        if self._prefix_rows is None or self._prefix_rows[0] != version:
            self._prefix_rows = (version, self.shared_prompts.rows(self.scheduler.running))
        return self._prefix_rows[1]

    def _running_sampling(self) -> SamplingBatch:
        version = self.scheduler.version
        if self._sampling is None or self._sampling[0] != version:
            self._sampling = (version, self._sampling_of(self.scheduler.running))
        return self._sampling[1]

    def _sampling_of(self, sequences: list[Sequence]) -> SamplingBatch:
        params = [sequence.params for sequence in sequences]
        return SamplingBatch.of(params, self.device, [sequence.token_ids for sequence in sequences])

    def _routed(self, sequences: list[Sequence]) -> RoutedCopy | None:
        """The decoding step just launched: its rows' experts on their way to the host, if a row asked."""
        if not self.runner.moe_index or not any(s.params.return_routed_experts for s in sequences):
            return None
        return RoutedCopy(self.runner.routed[: len(sequences)])

    def _launch(
        self,
        sequences: list[Sequence],
        logits: torch.Tensor,
        params: SamplingBatch,
        context: int,
        routed: RoutedCopy | None = None,
    ) -> InflightStep:
        """Queue the sampling of one token per row (row i is `sequences[i]`) and its copy to the host."""
        uniforms = torch.tensor([sequence.rng.random() for sequence in sequences], dtype=torch.float64)
        if self.device.type == "cuda":
            uniforms = uniforms.pin_memory()  # so that the copy does not wait for the device
        sampled = sample(logits, params, uniforms.to(self.device, non_blocking=True), self.sampling_kernels)
        return InflightStep(sequences, self.scheduler.version, context, sampled, sampled.to_host(), routed)

    def _finish(self, step: InflightStep) -> None:
        """Record the tokens a step sampled, and free finished samples' slots. Rows of samples that left
        the batch while the step ran (it was launched ahead) were decoded for nothing and are skipped."""
        token_ids, logprobs, top_ids, top_logprobs = step.host.read()
        routed = step.routed.read() if step.routed is not None else None
        still_running = None if step.version == self.scheduler.version else set(self.scheduler.running)
        version = self.policy_version
        leaving = []
        for row, sequence in enumerate(step.sequences):
            if still_running is not None and sequence not in still_running:
                continue
            if sequence.abandoned:
                leaving.append(sequence)
                continue
            if math.isnan(logprobs[row]):  # NaN logits: the weights (or their precision) failed, not the request
                sequence.request.fail(AsyncRLError(NAN_LOGITS))
                leaving.append(sequence)
                continue
            request = sequence.params
            token = token_ids[row]
            if routed is not None and request.return_routed_experts:
                sequence.routed_experts.append(routed[row].copy())  # of the token this step was fed: the last one
            sequence.token_ids.append(token)
            sequence.logprobs.append(logprobs[row])
            sequence.policy_versions.append(version)
            top = []
            if request.top_logprobs:
                top = list(zip(top_ids[row][: request.top_logprobs], top_logprobs[row][: request.top_logprobs]))
                sequence.top_logprobs.append(top)
            self.generated_tokens += 1
            sequence.finish_reason = self._finish_reason(sequence, token)
            if sequence.request.on_token is not None:
                try:
                    sequence.request.on_token(
                        sequence.index, token, logprobs[row], top, version, sequence.finish_reason
                    )
                except Exception as error:  # noqa: BLE001 - a broken listener fails its request, not the batch
                    sequence.request.fail(error)
            if sequence.finish_reason is not None:
                leaving.append(sequence)
        if not leaving:
            return
        self._release(leaving)
        for sequence in leaving:
            if sequence.finish_reason is not None:
                sequence.request.sequence_finished()

    def _release_abandoned(self) -> None:
        abandoned = [sequence for sequence in self.scheduler.running if sequence.abandoned]
        if abandoned:
            self._release(abandoned)

    def _release(self, leaving: list[Sequence]) -> None:
        """Free the slots of `leaving` (running samples), keeping the others' KV cache where they now sit."""
        if self.shared_prompts is not None:
            # A leaving sample that holds its group's prompt hands it on before any slot is overwritten.
            for copy in self.shared_prompts.leave(set(leaving), self.scheduler.running):
                self.cache.move(copy.source, copy.target, copy.length)
        with self._wakeup:
            moves = self.scheduler.release(leaving)
        for move in moves:
            start = self.shared_prompts.shared_length(move.sequence) if self.shared_prompts is not None else 0
            self.cache.move(move.source, move.target, move.sequence.num_tokens, start)

    def _finish_reason(self, sequence: Sequence, token: int) -> str | None:
        request = sequence.params
        if (token in self.eos_token_ids and not request.ignore_eos) or token in sequence.request.stop_token_ids:
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

    def _load_weights(self, source: Path | str | Mapping[str, torch.Tensor]) -> None:
        """Copy new weights into the live model, in place (the model runner and its CUDA graphs read these
        very tensors), after checking they fit: a bad source must leave the old weights untouched, so
        nothing is copied until every key and shape is known to match."""
        if isinstance(source, Mapping):
            state, origin = dict(source), "the state dict"
        else:
            origin = f"'{source}'"
            try:
                state = load_state_dict(Path(source), self._staging_device(Path(source)))
            except FileNotFoundError as error:
                raise WeightsError(f"{error} (give the path of a published weights/step_N folder)") from None
            except Exception as error:
                raise WeightsError(f"weights in '{source}' could not be read: {error}") from None
        try:
            state = in_memory_state_dict(self.model.config, state)  # the checkpoint's layout -> ours (MoE experts)
        except (KeyError, ValueError, RuntimeError) as error:
            raise WeightsError(
                f"weights in {origin} do not fit the served model {self.cfg.model.name}: {error}"
            ) from None
        current = self.model.state_dict()
        # The publisher leaves out a tensor that is another one (tied lm_head / embeddings); such a key may
        # be missing as long as its twin is present. (Fused q/k/v blocks share storage, not memory.)
        address = {name: tensor.data_ptr() for name, tensor in current.items()}
        present = {address[name] for name in state if name in address}
        missing = [name for name in current if name not in state and address[name] not in present]
        unexpected = [name for name in state if name not in current]
        reshaped = [name for name in state if name in current and state[name].shape != current[name].shape]
        problems = [
            f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
            for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", reshaped))
            if names
        ]
        if problems:
            raise WeightsError(
                f"weights in {origin} do not fit the served model {self.cfg.model.name} ({'; '.join(problems)})"
            )
        check_weight_values(state.items(), origin, self.device)
        self.model.load_state_dict(state, strict=False)
        self.runner.weights_loaded()

    def _staging_device(self, folder: Path) -> torch.device:
        """Where a weights folder is read to: the GPU when it has room for a second copy of the weights (the
        copy into the model is then device to device), else host memory, as on CPU."""
        if self.device.type != "cuda":
            return self.device
        model_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        file_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        free_bytes = torch.cuda.mem_get_info(self.device)[0]
        return self.device if max(model_bytes, file_bytes) < 0.9 * free_bytes else torch.device("cpu")


def check_weight_values(
    tensors: Iterable[tuple[str, torch.Tensor]], origin: str, device: torch.device | None = None
) -> None:
    """New weights must be finite floating-point numbers: integers would be cast silently, and one NaN or inf
    makes every sample NaN. Raises WeightsError naming the first bad tensor. With `device`, each tensor is
    checked there, one at a time (on one CPU thread, checking 0.6B bf16 values took ~3 s; on a GPU, ms)."""
    for name, tensor in tensors:
        if not tensor.is_floating_point():
            raise WeightsError(f"weights in {origin}: {name} holds {tensor.dtype} values, not floating-point numbers")
        if not torch.isfinite(tensor if device is None else tensor.to(device)).all():
            raise WeightsError(f"weights in {origin}: {name} holds NaN or infinite values (the old weights stay)")


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
