"""kill -9, for real, of each process of an `asyncrl rl` run on a tiny model: a trainer rank, the torchrun agent,
the orchestrator (with a local env-server and its workers), the only inference server, and the launcher itself.
Whichever dies, no process of the run outlives it by more than a few seconds, and `asyncrl rl --resume` then
continues from the last complete checkpoint with no step lost or trained twice. (With two inference servers
the run goes on: tests/integration/test_pool.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from asyncrl.checkpoints import RL_PARTS, checkpoint_problem
from asyncrl.metrics import read_jsonl
from asyncrl.models.offline import init_model

pytestmark = pytest.mark.integration

STEPS = 4
ARGS = [
    "--max-steps", str(STEPS), "--seq-len", "96", "--ckpt.interval", "1", "--orchestrator.batch-size", "8",
    "--orchestrator.group-size", "4", "--orchestrator.sampling.max-tokens", "8", "--trainer.optim.lr", "1e-2",
    "--deployment.inference-threads", "1", "--deployment.trainer-threads", "1",
    "--deployment.inference-device", "cpu", "--deployment.trainer-device", "cpu",
]  # fmt: skip
LOCAL_ENV_SERVER = ["--orchestrator.environments.reverse_text.env-server", "local"]
# Seconds the processes of a run may outlive the one killed: the launcher notices a death within half a second
# and gives the others 10 s to stop on SIGTERM before it kills them; the kernel kills the children of a
# killed launcher at once.
SURVIVAL = 15.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny"
    init_model(path, "tiny")
    return path


def command(model: Path, run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl", "rl", "--model.name", str(model), "--output-dir", str(run), *ARGS, *extra]


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def wait_for_checkpoint(launcher: subprocess.Popen, run: Path, step: int, timeout: float = 240) -> None:
    """Until both parts of checkpoint `step` are whole, so that a resume has one to start from."""
    deadline = time.monotonic() + timeout
    while checkpoint_problem(run, step, RL_PARTS) is not None:
        assert launcher.poll() is None, launcher.stdout.read()
        assert time.monotonic() < deadline, f"checkpoint {step} not written in {timeout:.0f}s"
        time.sleep(0.1)


def victim(kind: str, launcher: psutil.Process, processes: list[psutil.Process]) -> psutil.Process:
    def one(test) -> psutil.Process:
        [found] = [p for p in processes if test(" ".join(p.cmdline()))]
        return found

    return {
        "trainer rank": lambda: one(lambda c: " asyncrl trainer " in c and "torch.distributed.run" not in c),
        "torchrun agent": lambda: one(lambda c: "torch.distributed.run" in c),
        "orchestrator": lambda: one(lambda c: "orchestrator.toml" in c),
        "inference server": lambda: one(lambda c: "inference.toml" in c),
        "launcher": lambda: launcher,
    }[kind]()


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("trainer rank", []),
        ("torchrun agent", []),
        ("orchestrator", LOCAL_ENV_SERVER),
        ("inference server", []),
        ("launcher", []),
    ],
)
def test_a_process_killed_ends_the_whole_run_and_resume_loses_no_step(tiny_model, tmp_path, kind, extra):
    run = tmp_path / "run"
    launcher = subprocess.Popen(
        command(tiny_model, run, *extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment()
    )
    processes: list[psutil.Process] = []
    try:
        wait_for_checkpoint(launcher, run, 1)
        processes = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
        if extra == LOCAL_ENV_SERVER:
            assert any("env-server" in p.cmdline() for p in processes), "no env-server process to check"
        victim(kind, processes[0], processes).kill()
        killed_at = time.monotonic()
        code = launcher.wait(timeout=SURVIVAL)
        _, alive = psutil.wait_procs(processes[1:], timeout=max(0.1, SURVIVAL - (time.monotonic() - killed_at)))
        assert not alive, f"outlived the {kind} by {SURVIVAL:.0f}s: {[p.cmdline() for p in alive]}"
        output = launcher.stdout.read()
        if kind == "launcher":
            assert code == -9
        else:
            assert code == 1 and "exited with code" in output and "stopped the others" in output, output
    finally:
        for process in [launcher, *processes]:
            try:
                process.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass

    result = subprocess.run(
        [*command(tiny_model, run, *extra), "--resume"], capture_output=True, text=True, timeout=300, env=environment()
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming" in result.stdout
    if kind == "launcher":  # its lock is left behind, and no process holds it
        assert "taking over the stale lock" in result.stdout
    records = read_jsonl(run / "metrics.jsonl")
    for source in ("trainer", "orchestrator"):
        steps = [r["step"] for r in records if r["source"] == source]
        assert sorted(steps) == list(range(1, STEPS + 1)), f"{source} steps lost or repeated: {steps}"
    groups = [r["group"] for r in read_jsonl(run / "samples.jsonl")]
    assert len(groups) == len(set(groups)), f"a group was trained on twice: {groups}"
