"""`inference.backend = "vllm"`: a vLLM server, run as a child process, behind asyncrl's routes.

vLLM's OpenAI server listens on an internal loopback port; the routes (the same app as the native engine's,
with the same limits and checks) reach it through this backend, token in, token out:

- generation goes to vLLM's token route `/inference/v1/generate` (registered by `--enable-scale-out`), streamed
  when the route streams. Every token reports the policy version that produced it: vLLM labels its output with
  the weight version it sampled under, and this backend sets that label on each update. A cancelled call
  closes its connection, and vLLM aborts the request.
- pause, resume and weight updates drive vLLM's RL routes (`VLLM_SERVER_DEV_MODE=1`): pause with `mode=keep`
  (requests in flight are frozen, not dropped), `collective_rpc("reload_weights")` from the published folder,
  set the weight version, resume.

vLLM's own routes are not reachable from outside: the child (`vllm_process.py`) listens on loopback only, on a
port of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from safetensors import safe_open
from safetensors.torch import save_file

from asyncrl.config.schema import InferenceConfig
from asyncrl.config.transfer_mode import transfer_mode
from asyncrl.errors import AsyncRLError
from asyncrl.inference.api.api_errors import APIError
from asyncrl.inference.api.prometheus import prometheus_text
from asyncrl.inference.backends.backend import WEIGHT_UPDATE_TIMEOUT, Backend
from asyncrl.inference.backends.vllm_process import VLLMProcess, cpu_scheduling_args, model_sizes, vllm_memory_args
from asyncrl.inference.engine.engine import WeightsError, check_weight_values
from asyncrl.inference.engine.sampling import MIN_TEMPERATURE
from asyncrl.inference.engine.sequence import Completion, GenerationRequest, TokenCallback
from asyncrl.loading import load_tokenizer
from asyncrl.transport.weights import ADAPTER_CONFIG, MARKER, WEIGHTS_FILE

log = logging.getLogger("asyncrl.inference")

CONTROL_TIMEOUT = 60.0  # seconds for vLLM's quick routes (health, metrics, pause, resume, weight version)
# Fields of a model config that must agree for new weights to fit the served model.
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
# The tied output head and the embedding it shares its weight with (Qwen3 and Llama checkpoints).
TIED_HEAD, TIED_EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


class VLLMBackend(Backend):
    name = "vllm"

    def __init__(self, child: VLLMProcess, cfg: InferenceConfig, served_config: dict[str, Any]):
        self.child = child
        self.cfg = cfg
        self.served_config = served_config
        self.tokenizer = load_tokenizer(cfg.model.name)
        self.vocab_size = served_config["vocab_size"]
        self.summary = f"vLLM at {child.url}, {cfg.model.dtype}"
        # Generation calls are as many as the routes' requests; each holds its connection until done.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(base_url=child.url, timeout=httpx.Timeout(None, connect=10), limits=limits)
        self._policy_version = 0
        self._paused = False
        self._exit_code: int | None = None

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def paused(self) -> bool:
        return self._paused

    async def call(
        self, method: str, route: str, timeout: float | None = CONTROL_TIMEOUT, **kwargs: Any
    ) -> httpx.Response:
        """One request to vLLM; `timeout` None for generation, which the caller's own timeout bounds."""
        try:
            response = await self.http.request(method, route, timeout=timeout, **kwargs)
        except httpx.TimeoutException:
            raise APIError(504, f"vLLM did not answer {route} in time") from None
        except httpx.TransportError as error:
            raise self._unreachable(error) from None
        if response.status_code != 200:
            raise _vllm_error(route, response.status_code, response.text, self.child.last_error)
        return response

    def _unreachable(self, error: Exception) -> APIError:
        return APIError(503, f"vLLM is not reachable ({error}); it may have stopped{self.child.why()}")

    async def generate(self, request: GenerationRequest, on_token: TokenCallback | None = None) -> list[Completion]:
        if request.n > 1 and request.temperature < MIN_TEMPERATURE:
            return await self._greedy_samples(request, on_token)
        body = {
            "model": self.cfg.model.name,
            "token_ids": request.prompt_ids,
            "sampling_params": self._sampling(request),
        }
        if on_token is None:
            result = (await self.call("POST", "/inference/v1/generate", timeout=None, json=body)).json()
            samples = [VLLMSample(request.top_logprobs) for _ in range(request.n)]
            for choice in result["choices"]:
                samples[choice["index"]].add(choice, self._policy_version)
        else:
            samples = await self._stream(request, body, on_token)
        return [sample.completion(self._policy_version) for sample in samples]

    async def _greedy_samples(self, request: GenerationRequest, on_token: TokenCallback | None) -> list[Completion]:
        """vLLM refuses n > 1 with greedy sampling ("n must be 1 when using greedy sampling"); the native engine
        takes it. So a greedy request of n samples goes to vLLM as n requests of one."""

        def relabel(index: int) -> TokenCallback | None:
            if on_token is None:
                return None
            return lambda _, *token: on_token(index, *token)

        one = dataclasses.replace(request, n=1)
        tasks = [asyncio.ensure_future(self.generate(one, relabel(index))) for index in range(request.n)]
        try:
            return [completion for completions in await asyncio.gather(*tasks) for completion in completions]
        finally:
            for task in tasks:
                task.cancel()

    def _sampling(self, request: GenerationRequest) -> dict[str, Any]:
        return {
            "n": request.n,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k if request.top_k < self.vocab_size else 0,
            "min_p": request.min_p,
            "max_tokens": request.max_tokens,
            "seed": request.seed,
            "stop_token_ids": list(request.stop_token_ids),
            "stop": list(request.stop) or None,
            "ignore_eos": request.ignore_eos,
            # Applied by vLLM in the native engine's order (bias, repetition, frequency, presence); the logprobs
            # are of the adjusted distribution there too (--logprobs-mode processed_logprobs).
            "logit_bias": {str(token): bias for token, bias in request.logit_bias.items()} or None,
            "repetition_penalty": request.repetition_penalty,
            "frequency_penalty": request.frequency_penalty,
            "presence_penalty": request.presence_penalty,
            # vLLM lists the sampled token first and cuts at `logprobs` entries: one more holds the top k.
            "logprobs": request.top_logprobs + 1 if request.top_logprobs else 0,
        }

    async def _stream(self, request: GenerationRequest, body: dict, on_token: TokenCallback) -> list[VLLMSample]:
        """Generate through vLLM's streamed token route, calling `on_token` as tokens arrive. vLLM may send a
        choice's finish reason in a chunk without tokens, so each choice's newest token is held back until the
        next chunk says whether it was the last."""
        samples = [VLLMSample(request.top_logprobs) for _ in range(request.n)]
        try:
            async with self.http.stream("POST", "/inference/v1/generate", json={**body, "stream": True}) as answer:
                if answer.status_code != 200:
                    raise _vllm_error(
                        "/inference/v1/generate",
                        answer.status_code,
                        (await answer.aread()).decode(),
                        self.child.last_error,
                    )
                async for line in answer.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if "error" in chunk:
                        raise APIError(500, f"vLLM: {_message(chunk['error'])}")
                    for choice in chunk.get("choices", []):
                        sample = samples[choice["index"]]
                        sample.add(choice, self._policy_version)
                        for token in sample.settled(choice.get("finish_reason") is not None):
                            on_token(choice["index"], *token)
        except httpx.TransportError as error:
            raise self._unreachable(error) from None
        return samples

    async def pause(self) -> None:
        await self.call("POST", "/pause", params={"mode": "keep"})
        self._paused = True

    async def resume(self) -> None:
        await self.call("POST", "/resume")
        self._paused = False

    async def update_weights(self, path: str | None, version: int) -> int:
        if path is None:
            raise APIError(
                400,
                "the vLLM backend loads weights from a published folder only (give its path, and keep "
                "weight_transfer.mode = 'filesystem')",
                "path",
            )
        started = time.perf_counter()
        config = await asyncio.to_thread(check_weights_fit, Path(path), self.served_config)
        tied = config.get("tie_word_embeddings", False)
        pause_here = not self._paused
        if pause_here:
            await self.call("POST", "/pause", params={"mode": "keep"})
        try:
            with tempfile.TemporaryDirectory(prefix="asyncrl-vllm-weights-") as scratch:
                folder = await asyncio.to_thread(with_tied_head, Path(path), tied, Path(scratch))
                rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
                await self.call("POST", "/collective_rpc", timeout=WEIGHT_UPDATE_TIMEOUT, json=rpc)
            await self.call("POST", "/update_weight_version", json={"new_version": str(version)})
            self._policy_version = version
        finally:
            if pause_here:
                await self.call("POST", "/resume")
        log.info("policy version %d live in vLLM after %.2fs (from %s)", version, time.perf_counter() - started, path)
        return version

    async def metrics(self) -> str:
        text = (await self.call("GET", "/metrics")).text
        totals = vllm_metrics(text)
        ours = [
            ("running_requests", "gauge", "Requests vLLM is decoding.", totals.get("vllm:num_requests_running", 0.0)),
            ("waiting_requests", "gauge", "Requests waiting in vLLM.", totals.get("vllm:num_requests_waiting", 0.0)),
            (
                "kv_cache_usage",
                "gauge",
                "Fraction of vLLM's KV cache in use.",
                totals.get("vllm:kv_cache_usage_perc", 0.0),
            ),
            ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", totals.get("vllm:prompt_tokens_total", 0.0)),
            (
                "generated_tokens_total",
                "counter",
                "Tokens sampled since start (rate() = tokens/s).",
                totals.get("vllm:generation_tokens_total", 0.0),
            ),
            ("policy_version", "gauge", "Policy version of the live weights (0 = base model).", self._policy_version),
            ("paused", "gauge", "1 while decoding is paused by /admin/pause.", int(self._paused)),
        ]
        return text + prometheus_text(ours)

    async def check_ready(self) -> None:
        await self.call("GET", "/health")

    def watch(self, on_failure: Callable[[], None]) -> None:
        def exited(code: int) -> None:
            self._exit_code = code
            on_failure()

        self.child.watch(exited)

    def close(self) -> None:
        self.child.stop()
        if self._exit_code is not None:
            raise AsyncRLError(f"vLLM exited with code {self._exit_code} while serving{self.child.why()}")


class VLLMSample:
    """One choice of a vLLM answer, gathered from its chunks (one chunk when not streamed)."""

    def __init__(self, top_logprobs: int):
        self.top_logprobs = top_logprobs
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.versions: list[int] = []  # the live version as each token arrived; vLLM's spans replace them
        self.spans: list[dict] | None = None
        self.finish_reason: str | None = None
        self._sent = 0  # tokens handed to on_token

    def add(self, choice: dict, version: int) -> None:
        entries = (choice.get("logprobs") or {}).get("content") or []
        self.token_ids += choice.get("token_ids") or []
        self.logprobs += [entry["logprob"] for entry in entries]
        for entry in entries:
            alternatives = {item["token_id"]: item["logprob"] for item in entry.get("top_logprobs", [])}
            ranked = sorted(alternatives.items(), key=lambda pair: -pair[1])
            self.tops.append(ranked[: self.top_logprobs] if self.top_logprobs else [])
        self.versions += [version] * (len(self.token_ids) - len(self.versions))
        self.spans = choice.get("weight_versions") or self.spans
        self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def settled(self, finished: bool) -> list[tuple]:
        """The (token, logprob, top, version, finish reason) of the tokens now known not to be the last, or all
        of them once finished (the last one with the finish reason)."""
        end = len(self.token_ids) if finished else len(self.token_ids) - 1
        tokens = []
        for t in range(self._sent, end):
            finish = self.finish_reason if finished and t == end - 1 else None
            tokens.append((self.token_ids[t], self.logprobs[t], self.tops[t], self.versions[t], finish))
        self._sent = max(self._sent, end)
        return tokens

    def completion(self, default_version: int) -> Completion:
        versions = policy_versions(self.spans, len(self.token_ids), default_version) if self.spans else self.versions
        return Completion(self.token_ids, self.logprobs, versions, self.tops, self.finish_reason or "stop")


def check_weights_fit(path: Path, served_config: dict[str, Any]) -> dict[str, Any]:
    """A folder vLLM cannot load would kill its engine, and weights it can load but should not (NaN) would be
    served, so it is checked here first: complete (the STABLE marker), of the served model's shape, finite
    floating-point values. Returns the folder's model config."""
    from transformers import AutoConfig

    if not (path / MARKER).exists():
        raise WeightsError(
            f"weights folder '{path}' has no {MARKER} marker: it is missing or half-written "
            "(give the path of a published weights/step_N folder)"
        )
    if (path / ADAPTER_CONFIG).exists():
        raise WeightsError(
            f"'{path}' holds a LoRA adapter; the vLLM backend reloads full weights only (train without LoRA, or "
            "serve with inference.backend = 'native')"
        )
    try:
        config = AutoConfig.from_pretrained(str(path)).to_dict()
    except (OSError, ValueError) as error:
        raise WeightsError(f"weights in '{path}' have no readable config.json: {error}") from None
    wrong = [
        f"{field} {config.get(field)} != {served_config.get(field)}"
        for field in SHAPE_FIELDS
        if config.get(field) != served_config.get(field)
    ]
    if wrong:
        raise WeightsError(f"weights in '{path}' do not fit the served model ({', '.join(wrong)})")
    try:
        with safe_open(path / WEIGHTS_FILE, "pt") as weights:
            check_weight_values(((name, weights.get_tensor(name)) for name in weights.keys()), f"'{path}'")
    except OSError as error:
        raise WeightsError(f"weights in '{path}' could not be read: {error}") from None
    return config


def with_tied_head(path: Path, tied: bool, scratch: Path) -> Path:
    """The folder vLLM should reload from. The publisher leaves out `lm_head.weight` when it is tied to the
    embeddings, and vLLM's in-place reload then keeps its old head ("ParallelLMHead: Failed to load
    weights"): the new policy would be served with the old head. So vLLM gets links to the published files
    in `scratch`, plus the head written out as a second safetensors file."""
    with safe_open(path / WEIGHTS_FILE, "pt") as weights:
        if not tied or TIED_HEAD in weights.keys() or TIED_EMBEDDING not in weights.keys():
            return path
        head = weights.get_tensor(TIED_EMBEDDING)
    for file in path.iterdir():
        (scratch / file.name).symlink_to(file.resolve())
    save_file({TIED_HEAD: head}, scratch / "tied_lm_head.safetensors")
    return scratch


def policy_versions(spans: list[dict] | None, length: int, default: int) -> list[int]:
    """vLLM's weight-version spans ([{version, start, end}] over output tokens) as one version per token."""
    versions = [default] * length
    for span in spans or []:
        label = str(span["version"])
        version = int(label) if label.isdigit() else default
        versions[span["start"] : span["end"]] = [version] * (span["end"] - span["start"])
    return versions


def vllm_metrics(text: str) -> dict[str, float]:
    """Sum each vLLM sample over its label sets: `vllm:num_requests_running{engine="0",...} 2.0`."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name = name_and_labels.split("{", 1)[0]
        try:
            totals[name] = totals.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return totals


def _vllm_error(route: str, status: int, text: str, last_error: str | None = None) -> APIError:
    """vLLM's answer as our error; a failure of vLLM's own (5xx) names the newest exception vLLM printed, since
    its answer rarely says more than that its engine failed."""
    try:
        message = _message(json.loads(text))
    except ValueError:
        message = text[:500] or f"HTTP {status}"
    if status >= 500 and last_error:
        message += f" (vLLM's last error: {last_error})"
    return APIError(status if status < 500 else 500, f"vLLM {route}: {message}")


def _message(body: Any) -> str:
    error = body.get("error", body) if isinstance(body, dict) else body
    return str(error.get("message", error) if isinstance(error, dict) else error)[:500]


# ---- the process ----


def start_vllm(cfg: InferenceConfig) -> VLLMBackend:
    """Start vLLM and wait until it answers (up to `inference.startup_timeout`); on any failure it is stopped."""
    problem = transfer_mode(cfg.weight_transfer.mode).backend_problem("vllm")
    if problem:
        raise AsyncRLError(problem)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request to vLLM otherwise
    child = VLLMProcess(cfg)
    try:
        gpu = child.probe()
        served_config, token_bytes, weight_bytes = model_sizes(cfg.model.name, cfg.model.dtype)
        scheduling = cpu_scheduling_args(cfg) if gpu is None else []
        child.start(vllm_memory_args(cfg, token_bytes, weight_bytes, gpu) + scheduling)
        child.wait_ready(cfg.startup_timeout)
        child.label_version(0)
        return VLLMBackend(child, cfg, served_config)
    except BaseException:
        child.stop()
        raise
