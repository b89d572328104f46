"""`asyncrl rl`: one config in, three processes out.

The configs of the processes and the checks come first (run_setup.py), then the run folder's lock (run_lock.py)
and the folder itself (output_dir.py). Inference starts first (the others need it), then the orchestrator,
then the trainer under torchrun. Each child writes to its own log under `<output_dir>/logs/`; the launcher
shows one live view read from `metrics.jsonl` (live_view.py) while it watches the children (supervision.py):
if one fails, the others are stopped, each with every process it started, and the child's error is shown.
Every child dies with the launcher, however the launcher ends (processes.py).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

from asyncrl import preflight
from asyncrl.config import InferenceConfig, OrchestratorConfig, RLConfig, TrainerConfig, to_toml, write_toml
from asyncrl.config.schema import ResumeConfig
from asyncrl.errors import AsyncRLError
from asyncrl.live_view import Progress, console
from asyncrl.output_dir import held_run, prepare_output_dir, resume_run
from asyncrl.run_lock import RunLock
from asyncrl.run_setup import check_before_start, placement, replica_names, resolve
from asyncrl.supervision import Child, ChildFailed, report_failure, start, stop, supervise, wait_healthy
from asyncrl.trackers import Trackers


class Stopped(BaseException):
    """A signal asked the launcher to stop (SIGTERM from a scheduler, SIGHUP from a closed terminal)."""

    def __init__(self, signum: int):
        self.signum = signum


def _stop_on_signal(signum, frame) -> None:
    raise Stopped(signum)


def run_rl(cfg: RLConfig, dry_run: bool = False, clean: bool = False) -> int:
    output_dir = Path(cfg.output_dir)
    replicas, orchestrator, trainer = resolve(cfg)
    names = replica_names(len(replicas))
    configs = {**dict(zip(names, replicas)), "orchestrator": orchestrator, "trainer": trainer}
    if dry_run:
        return dry_run_configs(output_dir, configs)

    check_before_start(cfg, replicas, orchestrator, trainer)
    lock = RunLock.acquire(output_dir, "asyncrl rl")
    try:
        return _launch(cfg, configs, orchestrator, trainer, replicas, clean)
    finally:
        lock.release()


def dry_run_configs(output_dir: Path, configs: dict) -> int:
    """Print the resolved configs, and write them to output_dir/configs unless the folder holds a run (a live
    one, or one that ran): a preview never rewrites a run's own configs."""
    preflight.check_output_dir(output_dir)
    for name, config in configs.items():
        console.print(f"# {name}", style="bold")
        console.print(to_toml(config), markup=False)
    held = held_run(output_dir)
    if held:
        console.print(
            f"(dry run: nothing written, nothing started: {output_dir} holds a run ({', '.join(held)}))",
            markup=False,
            soft_wrap=True,
        )
        return 0
    try:
        lock = RunLock.acquire(output_dir, "asyncrl rl --dry-run")
    except AsyncRLError as busy:
        console.print(f"(dry run: nothing written, nothing started: {busy})", markup=False, soft_wrap=True)
        return 0
    with lock:
        for name, config in configs.items():
            write_toml(config, output_dir / "configs" / f"{name}.toml")
    console.print(f"(dry run: configs written to {output_dir / 'configs'}; nothing started)")
    return 0


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
            **placement(cfg.deployment).trainer_env(os.environ.get("CUDA_VISIBLE_DEVICES")),
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
        stop(children)
        report_failure(failed, output_dir)
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
