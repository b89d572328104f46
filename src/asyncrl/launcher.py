"""`asyncrl rl`: one config in, three processes out.

Inference starts first (the others need it), then the orchestrator, then the trainer under torchrun. Each
child writes to its own log under `<output_dir>/logs/`; the launcher shows one live progress view read from
`metrics.jsonl`. If a child fails, the others are stopped and its last log lines are shown.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from asyncrl import checkpoints
from asyncrl.config import InferenceConfig, OrchestratorConfig, RLConfig, TrainerConfig, to_toml, write_toml
from asyncrl.config.schema import ResumeConfig
from asyncrl.errors import AsyncRLError
from asyncrl.loading import check_model_name

console = Console(stderr=False, highlight=False)

RUN_ARTIFACTS = ("configs", "logs", "rollouts", "weights", "checkpoints", "metrics.jsonl", "samples.jsonl")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve(cfg: RLConfig) -> tuple[InferenceConfig, OrchestratorConfig, TrainerConfig]:
    """Per-process configs: shared keys are already copied by the loader; here the deployment decides
    ports, devices and threads."""
    dep = cfg.deployment
    inference = cfg.inference.model_copy(deep=True)
    orchestrator = cfg.orchestrator.model_copy(deep=True)
    trainer = cfg.trainer.model_copy(deep=True)
    if inference.port == 0:
        inference.port = free_port(inference.host)
    orchestrator.inference_url = f"http://{inference.host}:{inference.port}"
    if inference.weight_transfer.mode == "broadcast" and inference.weight_transfer.port == 0:
        port = free_port(inference.weight_transfer.host)  # one port for the pair: the trainer joins inference
        for section in (inference, orchestrator, trainer):
            section.weight_transfer.port = port
    orchestrator.num_trainer_ranks = dep.trainer_ranks

    inference.device, trainer.device = _devices(dep)
    cores = os.cpu_count() or 1
    inference.num_threads = dep.inference_threads or max(1, cores // 2)
    trainer.num_threads = dep.trainer_threads or max(1, (cores - inference.num_threads) // dep.trainer_ranks)
    return inference, orchestrator, trainer


def _devices(dep) -> tuple[str, str]:
    if dep.inference_device != "auto" or dep.trainer_device != "auto":
        return dep.inference_device, dep.trainer_device
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        return "cpu", "cpu"
    # One GPU: both share it. More: inference takes the first, the trainer the rest (see _trainer_env).
    return "cuda:0", "cuda"


def _trainer_env(dep, trainer: TrainerConfig) -> dict[str, str]:
    if trainer.device != "cuda":
        return {}
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        return {}
    ids = list(range(1, gpus))[: dep.trainer_ranks]
    if len(ids) < dep.trainer_ranks:
        raise AsyncRLError(
            f"deployment.trainer_ranks = {dep.trainer_ranks} but only {len(ids)} GPUs are left for the "
            "trainer after inference takes one"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}


def prepare_output_dir(output_dir: Path, clean: bool) -> None:
    existing = [name for name in RUN_ARTIFACTS if (output_dir / name).exists()]
    if existing and not clean:
        raise AsyncRLError(
            f"output_dir '{output_dir}' already holds a run ({', '.join(existing)}); pass --clean to delete it, "
            "--resume to continue it from its last checkpoint, or set output_dir to a new folder"
        )
    for name in existing:
        path = output_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (output_dir / "logs").mkdir(parents=True, exist_ok=True)


def resume_run(output_dir: Path, requested: int | None, max_steps: int, clean: bool) -> int:
    """The checkpoint `asyncrl rl --resume` continues from (`requested`, or the newest whole one); the run
    folder is rewound to it, so later weights, batches and metric lines are made again."""
    if clean:
        raise AsyncRLError("--resume continues the run in output_dir and --clean deletes it; give one of them")
    step, refused = checkpoints.find_resume_step(output_dir, checkpoints.RL_PARTS, requested)
    for line in refused:
        console.print(f"{line}; trying an older one", markup=False, soft_wrap=True)
    if step >= max_steps:
        raise AsyncRLError(f"checkpoint step {step} is already at max_steps ({max_steps}); raise max_steps to go on")
    checkpoints.rewind(output_dir, step)
    (output_dir / "logs").mkdir(parents=True, exist_ok=True)
    console.print(f"resuming {output_dir} from checkpoint step {step}", markup=False, soft_wrap=True)
    return step


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path

    def tail(self, lines: int = 25) -> str:
        """The end of the child's log; for the trainer, also of each rank's log (tracebacks land there)."""
        logs = [self.log, *sorted(self.log.with_suffix("").glob("rank_*.log"))]
        parts = []
        for log in logs:
            text = log.read_text(errors="replace") if log.exists() else ""
            if text.strip():
                parts.append(f"--- {log}\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(parts)


def start(name: str, argv: list[str], log: Path, env: dict[str, str]) -> Child:
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = open(log, "ab")
    # A session of its own lets us stop the child and everything it started (torchrun's ranks) at once.
    process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    handle.close()
    return Child(name, process, log)


def stop(children: list[Child], grace: float = 10.0) -> None:
    for child in children:
        if child.process.poll() is None:
            try:
                os.killpg(child.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(child.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.process.wait()


def wait_healthy(child: Child, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.process.poll() is not None:
            raise ChildFailed(child)
        try:
            if httpx.get(f"{url}/health", timeout=2).json().get("ready"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise AsyncRLError(f"inference server not ready after {timeout:.0f}s (see {child.log})")


class ChildFailed(Exception):
    def __init__(self, child: Child):
        self.child = child


class Progress:
    """The live view: latest trainer and orchestrator metrics, read from metrics.jsonl."""

    def __init__(self, metrics_path: Path, max_steps: int):
        self.path = metrics_path
        self.max_steps = max_steps
        self.start = time.time()
        self.latest: dict[str, dict] = {}
        self.offset = 0
        self.printed_step = 0

    def refresh(self) -> None:
        """Read the lines appended since the last refresh (whole lines only)."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            if line.strip():
                record = json.loads(line)
                self.latest[record["source"]] = record

    def line(self) -> str:
        orch, train = self.latest.get("orchestrator", {}), self.latest.get("trainer", {})
        return (
            f"step {train.get('step', 0)}/{self.max_steps}  "
            f"reward {orch.get('reward/mean', float('nan')):.3f} (batch {orch.get('step', 0)})  "
            f"train {train.get('perf/tokens_per_s', 0):.0f} tok/s  "
            f"generate {orch.get('perf/generate_tokens_per_s', 0):.0f} tok/s  "
            f"mismatch_kl {train.get('mismatch_kl', float('nan')):.2e}  "
            f"elapsed {time.time() - self.start:.0f}s"
        )

    def table(self) -> Table:
        orch, train = self.latest.get("orchestrator", {}), self.latest.get("trainer", {})
        table = Table(title="asyncrl rl", show_header=True)
        for column in (
            "trainer step",
            "batch",
            "reward",
            "train tok/s",
            "generate tok/s",
            "loss",
            "mismatch_kl",
            "elapsed",
        ):
            table.add_column(column, justify="right")
        table.add_row(
            f"{train.get('step', 0)}/{self.max_steps}",
            str(orch.get("step", 0)),
            f"{orch.get('reward/mean', float('nan')):.3f}",
            f"{train.get('perf/tokens_per_s', 0):.0f}",
            f"{orch.get('perf/generate_tokens_per_s', 0):.0f}",
            f"{train.get('loss', float('nan')):.4f}",
            f"{train.get('mismatch_kl', float('nan')):.2e}",
            f"{time.time() - self.start:.0f}s",
        )
        return table

    def new_step(self) -> bool:
        step = self.latest.get("trainer", {}).get("step", 0)
        if step > self.printed_step:
            self.printed_step = step
            return True
        return False


def supervise(children: list[Child], progress: Progress) -> None:
    """Wait until the trainer finishes; raise ChildFailed as soon as any child dies badly."""
    trainer = next(c for c in children if c.name == "trainer")
    live = Live(progress.table(), console=console, refresh_per_second=2) if console.is_terminal else None
    if live:
        live.start()
    try:
        while True:
            for child in children:
                code = child.process.poll()
                if code is not None and (code != 0 or child.name == "inference"):
                    raise ChildFailed(child)
            progress.refresh()
            if live:
                live.update(progress.table())
            elif progress.new_step():
                print(progress.line(), flush=True)
            if trainer.process.poll() == 0:
                return
            time.sleep(0.5)
    finally:
        if live:
            progress.refresh()
            live.update(progress.table())
            live.stop()


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        # As the server binds: connections of a run that just ended (TIME_WAIT) do not make the port busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise AsyncRLError(
                f"port {port} on {host} is in use (set inference.port, or 0 for any free port)"
            ) from None


def _terminate_as_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_rl(cfg: RLConfig, dry_run: bool = False, clean: bool = False) -> int:
    output_dir = Path(cfg.output_dir)
    inference, orchestrator, trainer = resolve(cfg)
    configs = {"inference": inference, "orchestrator": orchestrator, "trainer": trainer}
    if dry_run:
        for name, config in configs.items():
            console.print(f"# {name}", style="bold")
            console.print(to_toml(config), markup=False)
            write_toml(config, output_dir / "configs" / f"{name}.toml")
        console.print(f"(dry run: configs written to {output_dir / 'configs'}; nothing started)")
        return 0

    check_model_name(cfg.model.name)
    check_port_free(inference.host, inference.port)
    if cfg.resume is not None:
        step = resume_run(output_dir, cfg.resume.step, cfg.max_steps, clean)
        trainer.resume = orchestrator.resume = ResumeConfig(step=step)
    else:
        prepare_output_dir(output_dir, clean)
    # A scheduler's SIGTERM must stop the children too: they run in sessions of their own.
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    paths = {}
    for name, config in configs.items():
        paths[name] = output_dir / "configs" / f"{name}.toml"
        write_toml(config, paths[name])
    write_toml(cfg, output_dir / "configs" / "rl.toml")

    env = {
        **os.environ,
        "ASYNCRL_ADMIN_TOKEN": os.environ.get("ASYNCRL_ADMIN_TOKEN") or secrets.token_hex(16),
        "PYTHONUNBUFFERED": "1",
    }
    logs = output_dir / "logs"
    python = sys.executable
    children: list[Child] = []
    try:
        children.append(
            start(
                "inference",
                [python, "-m", "asyncrl", "inference", "@", str(paths["inference"])],
                logs / "inference.log",
                env,
            )
        )
        console.print(f"starting inference on {orchestrator.inference_url} (log: {logs / 'inference.log'})")
        wait_healthy(children[0], orchestrator.inference_url, cfg.deployment.startup_timeout)
        children.append(
            start(
                "orchestrator",
                [python, "-m", "asyncrl", "orchestrator", "@", str(paths["orchestrator"])],
                logs / "orchestrator.log",
                env,
            )
        )
        trainer_env = {**env, **_trainer_env(cfg.deployment, trainer), "ASYNCRL_RANK_LOG_DIR": str(logs / "trainer")}
        children.append(
            start(
                "trainer",
                [
                    python,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={cfg.deployment.trainer_ranks}",
                    "-m",
                    "asyncrl",
                    "trainer",
                    "@",
                    str(paths["trainer"]),
                ],
                logs / "trainer.log",
                trainer_env,
            )
        )
        console.print(f"started orchestrator and {cfg.deployment.trainer_ranks} trainer rank(s); logs in {logs}")
        supervise(children, Progress(output_dir / "metrics.jsonl", cfg.max_steps))
        # The orchestrator ends by itself after its last batch: let it finish logging and checkpointing it.
        try:
            next(c for c in children if c.name == "orchestrator").process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    except ChildFailed as failed:
        child = failed.child
        stop(children)
        console.print(
            f"[bold red]{child.name} exited with code {child.process.returncode}[/]; stopped the others. "
            "Last log lines:"
        )
        console.print(child.tail(), markup=False)
        return 1
    except KeyboardInterrupt:
        console.print("interrupted: stopping inference, orchestrator and trainer")
        stop(children)
        return 130
    except BaseException:
        stop(children)
        raise
    stop(children)
    console.print(
        f"done: {cfg.max_steps} steps; metrics in {output_dir / 'metrics.jsonl'}, "
        f"final weights in {output_dir / 'weights' / f'step_{cfg.max_steps}'}"
    )
    return 0
