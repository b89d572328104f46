"""Weight update latency: from "the trainer publishes version N" to "inference serves version N".

    python benchmarks/weight_update.py --preset tiny                      # CPU
    python benchmarks/weight_update.py --preset 30m                       # CPU, ~32M parameters
    python benchmarks/weight_update.py --preset qwen3-0.6b --device cuda  # one GPU: files and colocated
    python benchmarks/weight_update.py --preset qwen3-0.6b --device cuda \\
        --trainer-device cuda:0 --inference-device cuda:1                 # two GPUs: nccl broadcast

This process plays trainer rank 0 with the real trainer code: the model is loaded and sharded by FSDP2 (one
rank) and published by `asyncrl.trainer.rl.publish_weights`. The inference server is a real `asyncrl
inference` process, a fresh one for each transfer mode (a group's server joins one trainer). For each mode
and repeat:

    publish  = publish_weights(...)             filesystem: gather + cast to the serving dtype + write
               + publisher.wait()                           weights/step_N + STABLE
                                                broadcast:  gather + cast to the serving dtype + send + STABLE
                                                colocated:  gather + cast + copy into the buffers lent to the
                                                            server (CUDA IPC) + the server's copy out + STABLE
    trainer  = publish_weights(...) alone       what the trainer waits for: the folder is written in a
                                                background thread while it goes on with its next step
    update   = POST /admin/update_weights       filesystem: read the folder, copy into the live model
                                                broadcast:  take the received tensors, copy into the live model
                                                            (colocated: the same)
    total    = publish + update

The first update of each mode is a warm-up (nccl builds its communicator then; colocated lends its buffers)
and is not counted; the table shows medians. NCCL cannot put two ranks of one group on one GPU, and
colocated needs both on one device, so each setup measures the modes it can (the others print why not).
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from shapes import build_model  # benchmarks/, the script's own folder

from asyncrl.config.schema import ModelConfig, PerfConfig, TrainerConfig, WeightTransferConfig
from asyncrl.errors import AsyncRLError
from asyncrl.loading import DTYPES, load_tokenizer
from asyncrl.trainer.distributed import close_distributed, init_distributed
from asyncrl.trainer.model import parallelize, setup_model
from asyncrl.trainer.rl import publish_weights
from asyncrl.transport import weights
from asyncrl.transport.transfer import make_publisher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, model: Path, mode: str, port: int, group_port: int, token: str, log: Path) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "asyncrl", "inference", "--model.name", str(model), "--port", str(port),
        "--device", args.inference_device, "--model.dtype", args.dtype, "--max-batch-size", "8",
        "--num-threads", str(args.threads), "--weight-transfer.mode", mode,
        "--weight-transfer.port", str(group_port), "--weight-transfer.timeout", "600",
    ]  # fmt: skip
    if args.inference_device.startswith("cuda"):
        argv += ["--kv-cache-gb", "2"]
    env = {**os.environ, "ASYNCRL_ADMIN_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)


def wait_ready(http: httpx.Client, server: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"inference server exited:\n{log.read_text()[-3000:]}")
        try:
            if http.get("/health", timeout=2).json().get("ready"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"inference server not ready after {timeout:.0f}s (see {log})")


def update(http: httpx.Client, token: str, version: int, path: Path | None) -> None:
    body = {"version": version} if path is None else {"path": str(path), "version": version}
    response = http.post("/admin/update_weights", json=body, headers={"Authorization": f"Bearer {token}"})
    if response.status_code != 200 or response.json()["policy_version"] != version:
        raise SystemExit(f"update to version {version} failed: {response.status_code} {response.text[:500]}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="tiny, small, medium, 30m (asyncrl model init) or qwen3-0.6b")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: default for both sides")
    parser.add_argument("--trainer-device", default=None, help="e.g. cuda:0 (default: --device)")
    parser.add_argument("--inference-device", default=None, help="e.g. cuda:1 (default: --device)")
    parser.add_argument("--dtype", default=None, help="serving dtype (default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--repeats", type=int, default=5, help="timed updates per mode, after one warm-up")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of each side")
    parser.add_argument("--modes", default="filesystem,broadcast,colocated", help="transfer modes to measure")
    args = parser.parse_args()
    args.trainer_device = args.trainer_device or args.device
    args.inference_device = args.inference_device or args.device
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")

    root = Path(tempfile.mkdtemp(prefix="weight_update_"))
    model_dir = build_model(args.preset, root / "model")
    token = secrets.token_hex(8)
    world = init_distributed(args.trainer_device, args.threads, 0)
    rows = []
    try:
        model_cfg = ModelConfig(name=str(model_dir), dtype=args.dtype)
        model = parallelize(
            setup_model(model_cfg, world.device, PerfConfig()), 1, world.device, args.dtype, PerfConfig()
        )
        tokenizer = load_tokenizer(str(model_dir))
        parameters = sum(p.numel() for p in model.parameters())
        version = 0
        for mode in args.modes.split(","):
            port, group_port, log = free_port(), free_port(), root / f"inference-{mode}.log"
            server = start_server(args, model_dir, mode, port, group_port, token, log)
            http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
            try:
                wait_ready(http, server, log)
                transfer = WeightTransferConfig(mode=mode, port=group_port, timeout=600)
                # A large max_steps: a group mode writes the full folder only at its last step.
                cfg = TrainerConfig(model=model_cfg, output_dir=root / "run", max_steps=10**6, weight_transfer=transfer)
                try:  # a group mode opens the group, which the server joins
                    publisher = make_publisher(transfer, cfg.output_dir, world.device, DTYPES[args.dtype], True)
                except AsyncRLError as error:
                    rows.append((mode, None, None, None, None, str(error)))
                    continue
                folder = mode == "filesystem"
                trainer_s, publish_s, update_s = [], [], []
                for repeat in range(args.repeats + 1):
                    version += 1
                    with torch.no_grad():  # a new policy each time, as after an optimizer step
                        for parameter in model.parameters():
                            parameter.add_(1e-3)
                    synchronize(world.device)
                    start = time.perf_counter()
                    publish_weights(model, tokenizer, cfg, version, world, publisher)
                    synchronize(world.device)
                    handed_over = time.perf_counter()
                    publisher.wait()
                    published = time.perf_counter()
                    update(http, token, version, weights.weights_dir(cfg.output_dir, version) if folder else None)
                    served = time.perf_counter()
                    if repeat > 0:
                        trainer_s.append(handed_over - start)
                        publish_s.append(published - start)
                        update_s.append(served - published)
                trainer, publish, load = (statistics.median(s) for s in (trainer_s, publish_s, update_s))
                rows.append((mode, trainer, publish, load, publish + load, ""))
            finally:
                server.terminate()
                server.wait(timeout=30)
                http.close()
    finally:
        close_distributed()

    print(
        f"\nweight update latency: {args.preset} ({parameters / 1e6:.1f}M parameters, served in {args.dtype}), "
        f"trainer on {args.trainer_device}, inference on {args.inference_device}; median of {args.repeats}"
    )
    print(f"{'mode':<12}{'trainer s':>12}{'publish s':>12}{'update s':>12}{'total s':>12}")
    for mode, trainer, publish, load, total, note in rows:
        if total is None:
            print(f"{mode:<12}{'n/a':>12}{'n/a':>12}{'n/a':>12}{'n/a':>12}  {note.splitlines()[0][:300]}")
        else:
            print(f"{mode:<12}{trainer:>12.3f}{publish:>12.3f}{load:>12.3f}{total:>12.3f}")


if __name__ == "__main__":
    main()
