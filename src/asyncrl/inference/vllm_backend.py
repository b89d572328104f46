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

vLLM's own routes are not reachable from outside: the child listens on loopback only, on a port of its own.
Its memory is sized from our keys (`vllm_memory_args`), so that it starts on a small machine and leaves a
shared GPU's memory to the trainer.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from asyncrl.config.schema import InferenceConfig
from asyncrl.errors import AsyncRLError
from asyncrl.inference.api_errors import APIError
from asyncrl.inference.backend import WEIGHT_UPDATE_TIMEOUT, Backend
from asyncrl.inference.engine import (
    DEFAULT_CPU_KV_CACHE_GB,
    DEFAULT_GPU_KV_CACHE_FRACTION,
    WeightsError,
    check_weight_values,
)
from asyncrl.inference.kv_cache import GIB, bytes_per_token
from asyncrl.inference.prometheus import prometheus_text
from asyncrl.inference.sampling import MIN_TEMPERATURE
from asyncrl.inference.sequence import MAX_TOP_LOGPROBS, Completion, GenerationRequest, TokenCallback
from asyncrl.loading import DTYPES, load_tokenizer
from asyncrl.transport.weights import ADAPTER_CONFIG, MARKER, WEIGHTS_FILE

log = logging.getLogger("asyncrl.inference")

VLLM_SHUTDOWN_TIMEOUT = 15  # seconds vLLM's engine gets to drain and tear down on SIGTERM
STOP_GRACE = 25.0  # seconds vLLM gets to shut down on SIGTERM before its process group is killed
CONTROL_TIMEOUT = 60.0  # seconds for vLLM's quick routes (health, metrics, pause, resume, weight version)
GPU_HEADROOM = 2 * GIB  # beyond weights and KV cache: activations, CUDA graphs, the sampler
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
# Asks vLLM whether vllm is there and, on a GPU, how much memory is free (JSON on stdout).
PROBE = """
import importlib.util, json, sys
if importlib.util.find_spec("vllm") is None:
    sys.exit(3)
import torch
print(json.dumps({"gpu": list(torch.cuda.mem_get_info(0)) if torch.cuda.is_available() else None}))
"""


# ---- the child process ----


class VLLMProcess:
    """vLLM's OpenAI api_server as a child process on a free loopback port, in a process group of its own
    so that stopping it stops its engine-core workers too."""

    def __init__(self, cfg: InferenceConfig):
        self.cfg = cfg
        self.python = cfg.vllm.python or sys.executable
        self.port = _free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def command(self, memory_args: list[str]) -> list[str]:
        cfg = self.cfg
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            cfg.model.name,
            "--served-model-name",
            cfg.model.name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            cfg.model.dtype,
            "--max-model-len",
            str(cfg.seq_len),
            "--seed",
            str(cfg.seed),
            "--enable-scale-out",  # the token route /inference/v1/generate
            # Logprobs after temperature, like the native engine and the trainer's recompute (with top-k / top-p
            # they are renormalized over the kept tokens; see docs/inference.md).
            "--logprobs-mode",
            "processed_logprobs",
            # One more than OpenAI's 20 top logprobs: vLLM lists the sampled token first, then the top ones.
            "--max-logprobs",
            str(MAX_TOP_LOGPROBS + 1),
            # A prefix cache would let new requests reuse KV computed under older weights.
            "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log",
            # On SIGTERM, let the engine core finish and free its shared memory instead of being killed at once.
            "--shutdown-timeout",
            str(VLLM_SHUTDOWN_TIMEOUT),
            *memory_args,
            *cfg.vllm.args,  # last, so that they win over ours
        ]

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # /pause, /resume, /collective_rpc, weight versions
        # Its legacy KV-cache variable would override --kv-cache-memory-bytes, which we derive from our keys.
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        if self.cfg.device.startswith("cuda:"):
            index = int(self.cfg.device.removeprefix("cuda:"))
            visible = env.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
        return env

    def probe(self) -> tuple[int, int] | None:
        """Fail in seconds, not after a minute of vLLM start-up, when the Python has no vllm. Returns the free
        and total memory of vLLM's GPU, or None when vLLM runs on the CPU."""
        try:
            result = subprocess.run(
                [self.python, "-c", PROBE], capture_output=True, text=True, timeout=120, env=self.environment()
            )
        except FileNotFoundError:
            raise AsyncRLError(
                f"inference.vllm.python '{self.python}' does not exist (give a Python executable)"
            ) from None
        if result.returncode == 3:
            raise AsyncRLError(
                f"vllm is not installed for {self.python} (install it there, or point inference.vllm.python at "
                "a Python that has it; see docs/inference.md)"
            )
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise AsyncRLError(f"{self.python} could not import torch to size vLLM's memory: {last}")
        gpu = json.loads(result.stdout.strip().splitlines()[-1])["gpu"]
        return tuple(gpu) if gpu else None

    def start(self, memory_args: list[str]) -> None:
        command = self.command(memory_args)
        log.info("starting vLLM: %s", " ".join(command))
        self.process = subprocess.Popen(
            command, env=self.environment(), start_new_session=True, preexec_fn=_die_with_parent
        )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise AsyncRLError(f"vLLM exited with code {code} while starting (its output is above)")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AsyncRLError(
                    f"vLLM did not answer on {self.url} within {timeout:.0f}s (its output is above; raise "
                    "inference.startup_timeout if it was still loading)"
                )
            time.sleep(0.5)

    def label_version(self, version: int) -> None:
        """Name the loaded weights: vLLM reports this label with every token it samples under them."""
        response = httpx.post(f"{self.url}/update_weight_version", json={"new_version": str(version)}, timeout=30)
        if response.status_code != 200:
            raise AsyncRLError(f"vLLM refused /update_weight_version ({response.status_code}): {response.text[:300]}")

    def watch(self, on_exit: Callable[[int], None]) -> None:
        """Call `on_exit(code)` from a daemon thread if vLLM exits."""

        def poll() -> None:
            while (code := self.process.poll()) is None:
                time.sleep(0.5)
            on_exit(code)

        threading.Thread(target=poll, name="asyncrl-vllm-watch", daemon=True).start()

    def stop(self) -> None:
        """SIGTERM to vLLM's API server alone, which stops its engine core and workers in order: signalling the
        whole group at once had the server force-kill an engine core mid-teardown, leaving its shared memory in
        /dev/shm. Whatever of the group is left after STOP_GRACE seconds is killed."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def _free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when this server dies, even by SIGKILL (Linux prctl)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def vllm_memory_args(
    cfg: InferenceConfig, token_bytes: int, weight_bytes: int, gpu: tuple[int, int] | None
) -> list[str]:
    """vLLM's memory from our keys, by the native engine's rule: a KV cache of `kv_cache_gb`, or by default
    what `max_batch_size` sequences of `seq_len` tokens need, at most 2 GiB on a CPU and 80% of the GPU memory
    the weights leave free. vLLM's own default takes 92% of the machine (CPU) or of the GPU, which fails on a
    small machine and starves a trainer sharing the GPU. On a GPU, vLLM refuses to start unless
    `--gpu-memory-utilization` x total is free, so that fraction is what it needs: weights, KV cache, headroom."""
    wanted = cfg.max_batch_size * cfg.seq_len * token_bytes
    if cfg.kv_cache_gb is not None:
        kv_bytes = int(cfg.kv_cache_gb * GIB)
    elif gpu is None:
        kv_bytes = int(min(wanted, DEFAULT_CPU_KV_CACHE_GB * GIB))
    else:
        kv_bytes = int(min(wanted, DEFAULT_GPU_KV_CACHE_FRACTION * max(gpu[0] - weight_bytes, 0)))
    if kv_bytes < cfg.seq_len * token_bytes:
        raise AsyncRLError(
            f"the KV-cache budget ({kv_bytes / GIB:.3f} GiB) holds no sequence of seq_len {cfg.seq_len} tokens "
            f"({cfg.seq_len * token_bytes / GIB:.3f} GiB each) (raise inference.kv_cache_gb or lower inference.seq_len)"
        )
    args = ["--kv-cache-memory-bytes", str(kv_bytes), "--max-num-seqs", str(cfg.max_batch_size)]
    if gpu is not None:
        fraction = min((weight_bytes + kv_bytes + GPU_HEADROOM) / gpu[1], 0.95)
        args += ["--gpu-memory-utilization", f"{fraction:.4f}"]
    return args


def model_sizes(name: str, dtype: str) -> tuple[dict[str, Any], int, int]:
    """The served model's config (transformers' defaults filled in), the KV-cache bytes of one token, and the
    bytes of its weights in `dtype` (counted on the meta device: nothing is loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(name)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    token_bytes = bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, head_dim, DTYPES[dtype])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    element = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    weight_bytes = sum(parameter.numel() for parameter in model.parameters()) * element
    return config.to_dict(), token_bytes, weight_bytes


# ---- the backend ----


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
            raise _vllm_error(route, response.status_code, response.text)
        return response

    def _unreachable(self, error: Exception) -> APIError:
        return APIError(503, f"vLLM is not reachable ({error}); it may have stopped (see the server log)")

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
                    raise _vllm_error("/inference/v1/generate", answer.status_code, (await answer.aread()).decode())
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
            raise AsyncRLError(f"vLLM exited with code {self._exit_code} while serving (its output is above)")


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


def _vllm_error(route: str, status: int, text: str) -> APIError:
    try:
        message = _message(json.loads(text))
    except ValueError:
        message = text[:500] or f"HTTP {status}"
    return APIError(status if status < 500 else 500, f"vLLM {route}: {message}")


def _message(body: Any) -> str:
    error = body.get("error", body) if isinstance(body, dict) else body
    return str(error.get("message", error) if isinstance(error, dict) else error)[:500]


# ---- the process ----


def start_vllm(cfg: InferenceConfig) -> VLLMBackend:
    """Start vLLM and wait until it answers (up to `inference.startup_timeout`); on any failure it is stopped."""
    if cfg.weight_transfer.mode != "filesystem":
        raise AsyncRLError(
            f"weight_transfer.mode = '{cfg.weight_transfer.mode}' is not supported by the vLLM backend "
            "(set weight_transfer.mode = 'filesystem')"
        )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request to vLLM otherwise
    child = VLLMProcess(cfg)
    try:
        gpu = child.probe()
        served_config, token_bytes, weight_bytes = model_sizes(cfg.model.name, cfg.model.dtype)
        child.start(vllm_memory_args(cfg, token_bytes, weight_bytes, gpu))
        child.wait_ready(cfg.startup_timeout)
        child.label_version(0)
        return VLLMBackend(child, cfg, served_config)
    except BaseException:
        child.stop()
        raise
