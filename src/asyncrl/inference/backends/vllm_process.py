"""vLLM's OpenAI server as a child process of the inference server: started on a free loopback port with its
memory sized from our keys, awaited, and stopped in order. `vllm_backend.py` talks to it."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

import httpx
import torch

from asyncrl.config.schema import InferenceConfig
from asyncrl.errors import AsyncRLError
from asyncrl.inference.engine.engine import DEFAULT_CPU_KV_CACHE_GB, DEFAULT_GPU_KV_CACHE_FRACTION
from asyncrl.inference.engine.kv_cache import GIB, bytes_per_token
from asyncrl.inference.engine.sequence import MAX_TOP_LOGPROBS
from asyncrl.loading import DTYPES

log = logging.getLogger("asyncrl.inference")

VLLM_SHUTDOWN_TIMEOUT = 15  # seconds vLLM's engine gets to drain and tear down on SIGTERM
STOP_GRACE = 25.0  # seconds vLLM gets to shut down on SIGTERM before its process group is killed
GPU_HEADROOM = 2 * GIB  # beyond weights and KV cache: activations, CUDA graphs, the sampler
# vLLM's own default token budget of a step (its SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS)
VLLM_DEFAULT_BATCHED_TOKENS = 2048
# An exception line of vLLM's output: at the start of a line, or after the `[file.py:123] ` of its log prefix.
ERROR_LINE = re.compile(r"(?:^|\] )((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)): (.*)$")
# Errors that only say that another one happened first
CONSEQUENCES = ("EngineDeadError",)
# Asks vLLM's Python whether vllm is there and, on a GPU, how much memory is free (JSON on stdout).
PROBE = """
import importlib.util, json, sys
if importlib.util.find_spec("vllm") is None:
    sys.exit(3)
import torch
print(json.dumps({"gpu": list(torch.cuda.mem_get_info(0)) if torch.cuda.is_available() else None}))
"""


class VLLMProcess:
    """vLLM's OpenAI api_server as a child process on a free loopback port, in a process group of its own
    so that stopping it stops its engine-core workers too."""

    def __init__(self, cfg: InferenceConfig):
        self.cfg = cfg
        self.python = cfg.vllm.python or sys.executable
        self.port = _free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.last_error: str | None = None  # the newest exception line vLLM printed (see ERROR_LINE)

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
            command,
            env=self.environment(),
            start_new_session=True,
            preexec_fn=_die_with_parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        threading.Thread(
            target=self._relay, args=(self.process.stdout,), name="asyncrl-vllm-output", daemon=True
        ).start()

    def _relay(self, output: BinaryIO) -> None:
        """vLLM's output goes on to ours line by line, as it would unpiped; the newest exception line is kept, so
        that our errors can name the cause (the console shows only the last lines of a server's log)."""
        sink = sys.stdout.buffer
        for line in iter(output.readline, b""):
            sink.write(line)
            sink.flush()
            found = ERROR_LINE.search(line.decode(errors="replace").rstrip())
            if found and not found.group(1).endswith(CONSEQUENCES):
                self.last_error = f"{found.group(1).rsplit('.', 1)[-1]}: {found.group(2)}"[:300]

    def why(self) -> str:
        """What to add to a message about vLLM failing: its newest exception line, where it printed one."""
        cause = f"; its last error: {self.last_error}" if self.last_error else ""
        return f"{cause} (its output is above)"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise AsyncRLError(f"vLLM exited with code {code} while starting{self.why()}")
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


def cpu_scheduling_args(cfg: InferenceConfig) -> list[str]:
    """No prefill split over steps on a CPU. vLLM splits a prefill that does not fit a step's token budget, and
    then rewinds the request's random generator for the token it sampled and threw away, which a CPU generator
    cannot do: every seeded request (the orchestrator seeds each group) whose prefill was split killed vLLM's
    engine ("CPU Generator does not use offset"). Unsplit, a prefill that does not fit waits for the next step,
    and the budget must hold the longest prompt (vLLM configures itself so on CPUs for MLA models)."""
    return [
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        str(max(cfg.seq_len, VLLM_DEFAULT_BATCHED_TOKENS)),
    ]


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
