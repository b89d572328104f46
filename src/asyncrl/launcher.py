"""`asyncrl rl`: one config in, three processes out.

Before anything starts, the launcher checks what it can (preflight.py) and takes the run folder's lock
(run_lock.py). Inference starts first (the others need it), then the orchestrator, then the trainer under
torchrun. Each child writes to its own log under `<output_dir>/logs/`; the launcher shows one live progress
view read from `metrics.jsonl`. If a child fails, the others are stopped, each with every process it started,
and the child's error is shown. Every child dies with the launcher, however the launcher ends (processes.py).
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

from asyncrl import checkpoints, preflight
from asyncrl.config import InferenceConfig, OrchestratorConfig, RLConfig, TrainerConfig, to_toml, write_toml
from asyncrl.config.schema import ResumeConfig
from asyncrl.cpu_threads import usable_cores
from asyncrl.errors import AsyncRLError
from asyncrl.loading import check_model
from asyncrl.processes import child_of, stop_trees
from asyncrl.run_lock import RunLock
from asyncrl.trackers import Trackers

console = Console(stderr=False, highlight=False)

RUN_ARTIFACTS = (
    "configs", "logs", "rollouts", "weights", "checkpoints", "metrics.jsonl", "samples.jsonl", "wandb", "tensorboard",
)  # fmt: skip


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def replica_names(count: int) -> list[str]:
    """Config and log names of the inference servers: `inference` alone, or `inference_0`, `inference_1`, ..."""
    return ["inference"] if count == 1 else [f"inference_{i}" for i in range(count)]


def resolve(cfg: RLConfig) -> tuple[list[InferenceConfig], OrchestratorConfig, TrainerConfig]:
    """Per-process configs: shared keys are already copied by the loader; here the deployment decides
    ports, devices and threads, one inference config per replica."""
    dep = cfg.deployment
    orchestrator = cfg.orchestrator.model_copy(deep=True)
    trainer = cfg.trainer.model_copy(deep=True)
    devices, trainer.device = _devices(dep)
    cores = usable_cores()
    inference_threads = dep.inference_threads or max(1, cores // 2)
    replicas = []
    for i, device in enumerate(devices):
        replica = cfg.inference.model_copy(deep=True)
        replica.device = device
        replica.num_threads = max(1, inference_threads // len(devices))
        replica.port = free_port(replica.host) if cfg.inference.port == 0 else cfg.inference.port + i
        replicas.append(replica)
    orchestrator.inference_urls = [f"http://{r.host}:{r.port}" for r in replicas]
    if cfg.inference.weight_transfer.mode == "broadcast":
        # One group: trainer rank 0 hosts it on one port, replica i joins as member i + 1.
        port = cfg.inference.weight_transfer.port or free_port(cfg.inference.weight_transfer.host)
        for section in (*replicas, orchestrator, trainer):
            section.weight_transfer.port = port
            section.weight_transfer.receivers = len(replicas)
        for i, replica in enumerate(replicas):
            replica.weight_transfer.rank = i + 1
    orchestrator.num_trainer_ranks = dep.trainer_ranks
    trainer.num_threads = dep.trainer_threads or max(1, (cores - inference_threads) // dep.trainer_ranks)
    return replicas, orchestrator, trainer


def _devices(dep) -> tuple[list[str], str]:
    """The device of each inference replica, and the trainer's. Explicit devices are kept ('cuda:N' puts
    replica i on GPU N + i). Auto: CPUs only; one GPU shared by all; or the first GPUs for the replicas
    and the next ones for the trainer ranks (see _trainer_env)."""
    replicas = dep.inference_replicas
    if dep.inference_device != "auto" or dep.trainer_device != "auto":
        device = dep.inference_device
        if device.startswith("cuda:") and device[5:].isdigit():
            first = int(device[5:])
            return [f"cuda:{first + i}" for i in range(replicas)], dep.trainer_device
        return [device] * replicas, dep.trainer_device
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        return ["cpu"] * replicas, "cpu"
    if gpus == 1:
        return ["cuda:0"] * replicas, "cuda"
    if replicas + dep.trainer_ranks > gpus:
        raise AsyncRLError(
            f"deployment.inference_replicas = {replicas} and deployment.trainer_ranks = {dep.trainer_ranks} need "
            f"{replicas + dep.trainer_ranks} GPUs, and {gpus} are visible (lower them, or set "
            "deployment.inference_device and deployment.trainer_device to share GPUs)"
        )
    return [f"cuda:{i}" for i in range(replicas)], "cuda"


def _trainer_env(dep, trainer: TrainerConfig, replicas: list[InferenceConfig]) -> dict[str, str]:
    """With several GPUs, the trainer ranks see the GPUs no inference replica took."""
    if trainer.device != "cuda":
        return {}
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        return {}
    taken = {0 if r.device == "cuda" else int(r.device[5:]) for r in replicas if r.device.startswith("cuda")}
    free = [gpu for gpu in range(gpus) if gpu not in taken][: dep.trainer_ranks]
    if len(free) < dep.trainer_ranks:
        raise AsyncRLError(
            f"deployment.trainer_ranks = {dep.trainer_ranks} but only {len(free)} GPUs are left for the "
            f"trainer after the {len(replicas)} inference replica(s)"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, free))}


def prepare_output_dir(output_dir: Path, clean: bool) -> None:
    existing = [name for name in RUN_ARTIFACTS if (output_dir / name).exists()]
    # Configs alone are no run (a dry run wrote them, or a launch stopped before starting anything): replaced.
    if existing and existing != ["configs"] and not clean:
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

    @property
    def logs(self) -> list[Path]:
        """The child's log; for the trainer, also each rank's log (their errors land there)."""
        return [self.log, *sorted(self.log.with_suffix("").glob("rank_*.log"))]

    def tail(self, lines: int = 25) -> str:
        """The end of each of its logs."""
        parts = []
        for log in self.logs:
            text = log.read_text(errors="replace") if log.exists() else ""
            if text.strip():
                parts.append(f"--- {log}\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(parts)

    def error(self) -> str | None:
        """The one-line error an asyncrl process printed before exiting (`asyncrl trainer: error: ...`), if any."""
        for log in self.logs:
            text = log.read_text(errors="replace") if log.exists() else ""
            found = [line for line in text.splitlines() if line.startswith("asyncrl ") and ": error: " in line]
            if found:
                return found[-1]
        return None


def start(name: str, argv: list[str], log: Path, env: dict[str, str]) -> Child:
    """Start a child that dies with this process (call it from this process's only thread)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = open(log, "ab")
    # A session of its own: a Ctrl-C in the terminal reaches the launcher alone, which stops the children.
    process = subprocess.Popen(
        argv,
        stdout=handle,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=child_of(os.getpid()),
    )
    handle.close()
    return Child(name, process, log)


def stop(children: list[Child], grace: float = 10.0) -> None:
    """Stop every child with all it started (torchrun's ranks live in sessions of their own)."""
    stop_trees([c.process.pid for c in children if c.process.poll() is None], grace)
    for child in children:
        child.process.wait(timeout=10)


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
    raise AsyncRLError(f"inference server {url} not ready after {timeout:.0f}s (see {child.log})")


class ChildFailed(Exception):
    def __init__(self, child: Child):
        self.child = child


class Progress:
    """The live view, read from metrics.jsonl: what the trainer has trained and what the orchestrator has
    generated, side by side. They differ: with max_async_level >= 1 the orchestrator generates batch n + 1
    while the trainer trains on batch n, so the newest batch's reward is not the reward of the batch the
    trainer just stepped on. The lines read are also handed to the run's experiment trackers, if any."""

    def __init__(self, metrics_path: Path, max_steps: int, trackers: Trackers | None = None):
        self.path = metrics_path
        self.samples_path = metrics_path.with_name("samples.jsonl")
        self.max_steps = max_steps
        self.trackers = trackers
        self.start = time.time()
        self.trainer: dict = {}
        self.batch: dict = {}  # the newest batch's line
        self.batch_rewards: dict[int, float] = {}
        self.stale = {"dropped": 0, "cancelled": 0}  # rollouts dropped and groups cancelled as too old, so far
        self.offsets = {self.path: 0, self.samples_path: 0}
        self.printed_step = 0

    def _read_new(self, path: Path) -> list[dict]:
        """The lines appended since the last read (whole lines only)."""
        if not path.exists():
            return []
        with open(path, "rb") as f:
            f.seek(self.offsets[path])
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offsets[path] += len(complete)
        return [json.loads(line) for line in complete.decode().splitlines() if line.strip()]

    def refresh(self) -> None:
        for record in self._read_new(self.path):
            if record["source"] == "trainer":
                self.trainer = record
            elif record["source"] == "orchestrator" and "reward/mean" in record:  # a batch, not an eval
                self.batch = record
                self.batch_rewards[record["step"]] = record["reward/mean"]
                self.stale["dropped"] += record.get("off_policy/dropped", 0)
                self.stale["cancelled"] += record.get("groups/cancelled", 0)
            if self.trackers is not None:
                self.trackers.log(record)
        if self.trackers is not None:
            self.trackers.log_samples(self._read_new(self.samples_path))

    def close(self) -> None:
        self.refresh()
        if self.trackers is not None:
            self.trackers.close()

    def _figures(self) -> dict[str, str]:
        step, batch = self.trainer.get("step", 0), self.batch.get("step", 0)
        elapsed = time.time() - self.start
        eta = elapsed / step * (self.max_steps - step) if step else None
        return {
            "trained": f"{step}/{self.max_steps}",
            "reward": f"{self.batch_rewards.get(step, float('nan')):.3f}",
            "loss": f"{self.trainer.get('loss', float('nan')):.4f}",
            "mismatch_kl": f"{self.trainer.get('mismatch_kl', float('nan')):.2e}",
            "train": f"{self.trainer.get('perf/tokens_per_s', 0):.0f}",
            "batch": str(batch),
            "batch reward": f"{self.batch.get('reward/mean', float('nan')):.3f}",
            "generate": f"{self.batch.get('perf/generate_tokens_per_s', 0):.0f}",
            "servers": f"{self.batch.get('pool/servers_up', '?')}/{self._servers()}",
            "queue": f"{self.batch.get('queue/rollouts', 0)} / {self.batch.get('groups/in_flight', 0)}",
            "stale": f"{self.stale['dropped']} / {self.stale['cancelled']}",
            "elapsed": f"{elapsed:.0f}s",
            "eta": "?" if eta is None else f"{eta:.0f}s",
        }

    def _servers(self) -> int | str:
        return sum(key.endswith("/up") and key.startswith("server/") for key in self.batch) or "?"

    def line(self) -> str:
        f = self._figures()
        return (
            f"trained step {f['trained']} (its batch: reward {f['reward']}; loss {f['loss']}, "
            f"mismatch_kl {f['mismatch_kl']}, {f['train']} tok/s)  |  newest batch generated: {f['batch']} "
            f"(reward {f['batch reward']}, {f['generate']} tok/s; servers up {f['servers']}, rollouts queued / "
            f"groups in flight {f['queue']}, dropped / cancelled {f['stale']})  |  elapsed {f['elapsed']}, "
            f"ETA {f['eta']}"
        )

    def table(self) -> Table:
        f = self._figures()
        table = Table(
            title="asyncrl rl",
            caption="the orchestrator generates the next batches while the trainer trains on an earlier one",
            show_header=True,
        )
        columns = {
            "trained step": "trained",
            "its batch's reward": "reward",
            "loss": "loss",
            "mismatch_kl": "mismatch_kl",
            "train tok/s": "train",
            "newest batch": "batch",
            "newest batch's reward": "batch reward",
            "generate tok/s": "generate",
            "servers up": "servers",
            "queued / in flight": "queue",
            "dropped / cancelled": "stale",
            "elapsed": "elapsed",
            "ETA": "eta",
        }
        for column in columns:
            table.add_column(column, justify="right")
        table.add_row(*(f[key] for key in columns.values()))
        return table

    def new_step(self) -> bool:
        step = self.trainer.get("step", 0)
        if step > self.printed_step:
            self.printed_step = step
            return True
        return False


def supervise(children: list[Child], progress: Progress) -> None:
    """Wait until the trainer finishes; raise ChildFailed as soon as any child dies badly. An inference
    replica may die while another lives: the orchestrator sends its groups elsewhere."""
    trainer = next(c for c in children if c.name == "trainer")
    replicas = [c for c in children if c.name.startswith("inference")]
    lost: set[str] = set()
    live = Live(progress.table(), console=console, refresh_per_second=2) if console.is_terminal else None
    if live:
        live.start()
    try:
        while True:
            for child in children:
                code = child.process.poll()
                if code is None or (code == 0 and not child.name.startswith("inference")):
                    continue
                if child in replicas and any(r.process.poll() is None for r in replicas):
                    if child.name not in lost:
                        lost.add(child.name)
                        console.print(
                            f"[yellow]{child.name} exited with code {code}[/]; the run goes on with the other "
                            f"inference servers (log: {child.log})"
                        )
                    continue
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
        progress.close()
        if live:
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


class Stopped(BaseException):
    """A signal asked the launcher to stop (SIGTERM from a scheduler, SIGHUP from a closed terminal)."""

    def __init__(self, signum: int):
        self.signum = signum


def _stop_on_signal(signum, frame) -> None:
    raise Stopped(signum)


def check_before_start(cfg: RLConfig, replicas: list[InferenceConfig], orchestrator: OrchestratorConfig,
                       trainer: TrainerConfig) -> None:  # fmt: skip
    """Everything that can be found wrong before a process starts (preflight.py)."""
    preflight.check_output_dir(Path(cfg.output_dir))
    preflight.check_devices(replicas, trainer, cfg.deployment.trainer_ranks)
    tokenizer = check_model(cfg.model.name)
    environments = preflight.local_environments(orchestrator)
    for warning in preflight.check_prompt_lengths(environments, tokenizer, orchestrator):
        console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
    for replica in replicas:
        check_port_free(replica.host, replica.port)


def run_rl(cfg: RLConfig, dry_run: bool = False, clean: bool = False) -> int:
    output_dir = Path(cfg.output_dir)
    replicas, orchestrator, trainer = resolve(cfg)
    names = replica_names(len(replicas))
    configs = {**dict(zip(names, replicas)), "orchestrator": orchestrator, "trainer": trainer}
    if dry_run:
        preflight.check_output_dir(output_dir)
        for name, config in configs.items():
            console.print(f"# {name}", style="bold")
            console.print(to_toml(config), markup=False)
            write_toml(config, output_dir / "configs" / f"{name}.toml")
        console.print(f"(dry run: configs written to {output_dir / 'configs'}; nothing started)")
        return 0

    check_before_start(cfg, replicas, orchestrator, trainer)
    lock = RunLock.acquire(output_dir, "asyncrl rl")
    try:
        return _launch(cfg, configs, orchestrator, trainer, replicas, clean)
    finally:
        lock.release()


def _launch(cfg: RLConfig, configs: dict, orchestrator: OrchestratorConfig, trainer: TrainerConfig,
            replicas: list[InferenceConfig], clean: bool) -> int:  # fmt: skip
    """Prepare the run folder, start the processes and supervise them; the exit code."""
    output_dir = Path(cfg.output_dir)
    names = replica_names(len(replicas))
    if cfg.resume is not None:
        step = resume_run(output_dir, cfg.resume.step, cfg.max_steps, clean)
        trainer.resume = orchestrator.resume = ResumeConfig(step=step)
    else:
        prepare_output_dir(output_dir, clean)
    # A scheduler's SIGTERM must stop the children too: they run in sessions of their own. (A signal ignored,
    # as nohup ignores SIGHUP, stays ignored.)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _stop_on_signal)
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
        for name, url in zip(names, orchestrator.inference_urls):
            command = [python, "-m", "asyncrl", "inference", "@", str(paths[name])]
            children.append(start(name, command, logs / f"{name}.log", env))
            console.print(f"starting {name} on {url} (log: {logs / f'{name}.log'})")
        # The servers' own start-up limit, plus time for a server to say why it gave up before we do.
        for child, url in zip(children, orchestrator.inference_urls):
            wait_healthy(child, url, cfg.inference.startup_timeout + 30)
        children.append(
            start(
                "orchestrator",
                [python, "-m", "asyncrl", "orchestrator", "@", str(paths["orchestrator"])],
                logs / "orchestrator.log",
                env,
            )
        )
        trainer_env = {
            **env,
            **_trainer_env(cfg.deployment, trainer, replicas),
            "ASYNCRL_RANK_LOG_DIR": str(logs / "trainer"),
        }
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
        resolved = cfg.model_dump(mode="json") | {name: c.model_dump(mode="json") for name, c in configs.items()}
        trackers = Trackers.open(cfg.wandb, cfg.tensorboard, output_dir, resolved)
        supervise(children, Progress(output_dir / "metrics.jsonl", cfg.max_steps, trackers))
        # The orchestrator ends by itself after its last batch: let it finish logging and checkpointing it.
        try:
            next(c for c in children if c.name == "orchestrator").process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    except ChildFailed as failed:
        child = failed.child
        stop(children)
        error = child.error()
        if error is not None:
            console.print(
                f"[bold red]{child.name} exited with code {child.process.returncode}[/] ({error}); stopped the "
                f"others. Logs: {', '.join(str(log) for log in child.logs if log.exists())}",
                soft_wrap=True,
            )
            return 1
        console.print(
            f"[bold red]{child.name} exited with code {child.process.returncode}[/]; stopped the others. "
            "Last log lines:"
        )
        console.print(child.tail(), markup=False)
        return 1
    except (KeyboardInterrupt, Stopped) as stopped:
        signum = stopped.signum if isinstance(stopped, Stopped) else signal.SIGINT
        console.print(f"interrupted ({signal.Signals(signum).name}): stopping inference, orchestrator and trainer")
        stop(children)
        return 128 + signum
    except BaseException:
        stop(children)
        raise
    stop(children)
    console.print(
        f"done: {cfg.max_steps} steps; metrics in {output_dir / 'metrics.jsonl'}, "
        f"final weights in {output_dir / 'weights' / f'step_{cfg.max_steps}'}"
    )
    return 0
