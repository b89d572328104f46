"""`inference.backend = "vllm"`: vLLM serves the policy; this process gives it asyncrl's inference API.

vLLM's OpenAI server runs as a child process on an internal loopback port. This process serves the
configured host and port with the routes the orchestrator uses, so the orchestrator never knows which
backend it talks to:

- `/v1/generate` becomes a call to vLLM's token route `/inference/v1/generate` (registered by
  `--enable-scale-out`). Every token reports the policy version that produced it: vLLM labels its output
  with the weight version it sampled under, and this process sets that label on each update.
- `/admin/pause`, `/admin/resume`, `/admin/update_weights` drive vLLM's RL routes (`VLLM_SERVER_DEV_MODE=1`):
  pause with `mode=keep` (requests in flight are frozen, not dropped), `collective_rpc("reload_weights")`
  from the published folder, set the weight version, resume.
- `/health` and `/metrics` (vLLM's Prometheus text plus ours under the native backend's names).
- `/v1/...` (chat, completions, models; streaming too) and `/inference/v1/generate` go to vLLM unchanged.

vLLM's own admin routes are not reachable from outside: only the allow-listed paths above are passed on.
"""

from __future__ import annotations

import asyncio
import ctypes
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
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import PlainTextResponse, StreamingResponse
from safetensors import safe_open
from safetensors.torch import save_file
from starlette.background import BackgroundTask

from asyncrl.config.schema import InferenceConfig
from asyncrl.errors import AsyncRLError
from asyncrl.inference.server import (
    WEIGHT_UPDATE_TIMEOUT,
    APIError,
    GenerateBody,
    UpdateWeightsBody,
    admin_guard,
    bind_socket,
    http_server,
    install_error_handlers,
    prometheus_text,
)
from asyncrl.transport.weights import ADAPTER_CONFIG, MARKER, WEIGHTS_FILE

log = logging.getLogger("asyncrl.inference")

STOP_GRACE = 5.0  # seconds vLLM gets to exit on SIGTERM before it is killed
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
# Request headers that belong to one hop and must not be forwarded.
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive", "accept-encoding"}


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

    def command(self) -> list[str]:
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
            # A prefix cache would let new requests reuse KV computed under older weights.
            "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log",
            *cfg.vllm.args,
        ]

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # /pause, /resume, /collective_rpc, weight versions
        if self.cfg.device.startswith("cuda:"):
            index = int(self.cfg.device.removeprefix("cuda:"))
            visible = env.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
        return env

    def check_installed(self) -> None:
        """Fail in a second, not after a minute of vLLM start-up, when the Python has no vllm."""
        probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
        try:
            found = subprocess.run([self.python, "-c", probe], capture_output=True, timeout=60).returncode == 0
        except FileNotFoundError:
            raise AsyncRLError(
                f"inference.vllm.python '{self.python}' does not exist (give a Python executable)"
            ) from None
        if not found:
            raise AsyncRLError(
                f"vllm is not installed for {self.python} (install it there, or point inference.vllm.python at "
                "a Python that has it; see docs/inference.md)"
            )

    def start(self) -> None:
        log.info("starting vLLM: %s", " ".join(self.command()))
        self.process = subprocess.Popen(
            self.command(), env=self.environment(), start_new_session=True, preexec_fn=_die_with_parent
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
                    "inference.vllm.startup_timeout if it was still loading)"
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
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, None)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


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


# ---- the app ----


class VLLMBackend:
    """What the routes need to know of vLLM: its address, the live policy version, whether it is paused."""

    def __init__(self, url: str, model_name: str):
        self.model_name = model_name
        self.http = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=10))
        self.policy_version = 0
        self.paused = False
        self.weights_lock = asyncio.Lock()

    async def call(
        self, method: str, route: str, timeout: float | None = CONTROL_TIMEOUT, **kwargs: Any
    ) -> httpx.Response:
        """One request to vLLM; `timeout` None for generation, which the caller's own timeout bounds."""
        try:
            response = await self.http.request(method, route, timeout=timeout, **kwargs)
        except httpx.TimeoutException:
            raise APIError(504, f"vLLM did not answer {route} in time") from None
        except httpx.TransportError as error:
            raise APIError(503, f"vLLM is not reachable ({error}); it may have stopped (see the server log)") from None
        if response.status_code != 200:
            message = _error_message(response)
            raise APIError(response.status_code if response.status_code < 500 else 500, f"vLLM {route}: {message}")
        return response

    async def update_weights(self, path: str, version: int, served_config: dict[str, Any]) -> None:
        tied = check_weights_fit(Path(path), served_config).get("tie_word_embeddings", False)
        async with self.weights_lock:
            pause_here = not self.paused
            if pause_here:
                await self.call("POST", "/pause", params={"mode": "keep"})
            try:
                with tempfile.TemporaryDirectory(prefix="asyncrl-vllm-weights-") as scratch:
                    folder = await asyncio.to_thread(with_tied_head, Path(path), tied, Path(scratch))
                    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
                    await self.call("POST", "/collective_rpc", timeout=WEIGHT_UPDATE_TIMEOUT, json=rpc)
                await self.call("POST", "/update_weight_version", json={"new_version": str(version)})
                self.policy_version = version
            finally:
                if pause_here:
                    await self.call("POST", "/resume")


def check_weights_fit(path: Path, served_config: dict[str, Any]) -> dict[str, Any]:
    """A folder vLLM cannot load would kill its engine, so it is checked here first: complete (the STABLE
    marker) and of the served model's shape. Returns the folder's model config."""
    if not (path / MARKER).exists():
        raise APIError(
            400,
            f"weights folder '{path}' has no {MARKER} marker: it is missing or half-written "
            "(give the path of a published weights/step_N folder)",
            "path",
        )
    if (path / ADAPTER_CONFIG).exists():
        raise APIError(
            400,
            f"'{path}' holds a LoRA adapter; the vLLM backend reloads full weights only (train without LoRA, or "
            "serve with inference.backend = 'native')",
            "path",
        )
    try:
        config = model_config(str(path))
    except (OSError, ValueError) as error:
        raise APIError(400, f"weights in '{path}' have no readable config.json: {error}", "path") from None
    wrong = [
        f"{field} {config.get(field)} != {served_config.get(field)}"
        for field in SHAPE_FIELDS
        if config.get(field) != served_config.get(field)
    ]
    if wrong:
        raise APIError(400, f"weights in '{path}' do not fit the served model ({', '.join(wrong)})", "path")
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


def create_vllm_app(backend: VLLMBackend, cfg: InferenceConfig, served_config: dict[str, Any]) -> FastAPI:
    app = FastAPI(title="asyncrl inference (vLLM)", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    require_admin = admin_guard(cfg)

    @app.get("/health")
    async def health() -> dict:
        await backend.call("GET", "/health")
        return {
            "ready": True,
            "model": backend.model_name,
            "policy_version": backend.policy_version,
            "paused": backend.paused,
            "backend": "vllm",
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = (await backend.call("GET", "/metrics")).text
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
            ("policy_version", "gauge", "Policy version of the live weights (0 = base model).", backend.policy_version),
            ("paused", "gauge", "1 while decoding is paused by /admin/pause.", int(backend.paused)),
        ]
        return PlainTextResponse(text + prometheus_text(ours), media_type="text/plain; version=0.0.4")

    @app.post("/v1/generate")
    async def generate(body: GenerateBody) -> dict:
        request = {
            "model": backend.model_name,
            "token_ids": body.prompt_ids,
            "sampling_params": {
                "n": body.n,
                "temperature": body.temperature,
                "top_p": body.top_p,
                "top_k": body.top_k,
                "min_p": body.min_p,
                "max_tokens": body.max_tokens,
                "seed": body.seed,
                "stop_token_ids": body.stop_token_ids,
                "ignore_eos": body.ignore_eos,
                "logprobs": 0,  # the sampled token's logprob only
            },
        }
        result = (await backend.call("POST", "/inference/v1/generate", timeout=None, json=request)).json()
        choices = []
        for choice in sorted(result["choices"], key=lambda c: c["index"]):
            token_ids = choice["token_ids"]
            choices.append(
                {
                    "token_ids": token_ids,
                    "logprobs": [entry["logprob"] for entry in choice["logprobs"]["content"]],
                    "policy_versions": policy_versions(
                        choice.get("weight_versions"), len(token_ids), backend.policy_version
                    ),
                    "finish_reason": choice["finish_reason"],
                }
            )
        return {"choices": choices, "prompt_tokens": len(body.prompt_ids)}

    @app.post("/admin/pause", dependencies=[Depends(require_admin)])
    async def pause() -> dict:
        async with backend.weights_lock:
            await backend.call("POST", "/pause", params={"mode": "keep"})
            backend.paused = True
        return {"paused": True, "policy_version": backend.policy_version}

    @app.post("/admin/resume", dependencies=[Depends(require_admin)])
    async def resume() -> dict:
        async with backend.weights_lock:
            await backend.call("POST", "/resume")
            backend.paused = False
        return {"paused": False, "policy_version": backend.policy_version}

    @app.post("/admin/update_weights", dependencies=[Depends(require_admin)])
    async def update_weights(body: UpdateWeightsBody) -> dict:
        if body.path is None:
            raise APIError(
                400,
                "the vLLM backend loads weights from a published folder only (give its path, and keep "
                "weight_transfer.mode = 'filesystem')",
                "path",
            )
        started = time.perf_counter()
        await backend.update_weights(body.path, body.version, served_config)
        log.info(
            "policy version %d live in vLLM after %.2fs (from %s)",
            body.version,
            time.perf_counter() - started,
            body.path,
        )
        return {"policy_version": body.version}

    @app.api_route("/v1/{route:path}", methods=["GET", "POST"])
    async def openai_routes(request: Request, route: str) -> Response:
        return await forward(backend, request, f"/v1/{route}")

    @app.post("/inference/v1/generate")
    async def token_route(request: Request) -> Response:
        return await forward(backend, request, "/inference/v1/generate")

    return app


async def forward(backend: VLLMBackend, request: Request, route: str) -> Response:
    """Pass a request to vLLM and its answer back as it comes (server-sent events stay streamed)."""
    headers = {name: value for name, value in request.headers.items() if name.lower() not in HOP_HEADERS}
    outgoing = backend.http.build_request(
        request.method, route, params=request.query_params.multi_items(), headers=headers, content=await request.body()
    )
    try:
        answer = await backend.http.send(outgoing, stream=True)
    except httpx.TransportError as error:
        raise APIError(503, f"vLLM is not reachable ({error}); it may have stopped (see the server log)") from None
    kept = {name: value for name, value in answer.headers.items() if name.lower() not in HOP_HEADERS}
    return StreamingResponse(
        answer.aiter_raw(), status_code=answer.status_code, headers=kept, background=BackgroundTask(answer.aclose)
    )


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or f"HTTP {response.status_code}"
    error = body.get("error", body) if isinstance(body, dict) else body
    return str(error.get("message", error) if isinstance(error, dict) else error)[:500]


# ---- the process ----


def model_config(name: str) -> dict[str, Any]:
    """A model's config as transformers fills it in (defaults included), so two configs compare fairly."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name).to_dict()


def serve_vllm(cfg: InferenceConfig) -> int:
    if cfg.weight_transfer.mode != "filesystem":
        raise AsyncRLError(
            f"weight_transfer.mode = '{cfg.weight_transfer.mode}' is not supported by the vLLM backend "
            "(set weight_transfer.mode = 'filesystem')"
        )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request otherwise
    sock = bind_socket(cfg.host, cfg.port)
    child = VLLMProcess(cfg)
    # SIGTERM (the launcher stopping us) must run the `finally` below, which stops vLLM.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    exit_code: list[int] = []
    try:
        child.check_installed()
        served_config = model_config(cfg.model.name)
        child.start()
        child.wait_ready(cfg.vllm.startup_timeout)
        child.label_version(0)
        backend = VLLMBackend(child.url, cfg.model.name)
        server = http_server(create_vllm_app(backend, cfg, served_config))

        def vllm_exited(code: int) -> None:
            exit_code.append(code)
            server.should_exit = True

        child.watch(vllm_exited)
        host, port = sock.getsockname()[:2]
        log.info("serving %s with vLLM (policy version 0, %s) on http://%s:%d", cfg.model.name, child.url, host, port)
        server.run(sockets=[sock])
    finally:
        child.stop()
        sock.close()
    if exit_code:
        raise AsyncRLError(f"vLLM exited with code {exit_code[0]} while serving (its output is above)")
    return 0
