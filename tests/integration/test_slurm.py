"""`asyncrl slurm` against a real Slurm: a controller and two node daemons on this host (the distribution's
slurm-wlm), with a slurm.conf written here. The rendered script is submitted as a user would; the job runs
on node 1 (trainer and orchestrator) and node 2 (two inference servers).

Opt-in: `pytest -m slurm`, after the setup line of docs/clusters.md. Run otherwise, every test here is skipped.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from rl_runs import by_source  # tests/integration, on sys.path under pytest

from asyncrl.models.offline import init_model

pytestmark = [pytest.mark.slurm, pytest.mark.integration]

COMMANDS = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
SETUP = "sudo apt-get update && sudo apt-get install -y slurm-wlm"
STEPS = 30


def find(command: str) -> str | None:
    return shutil.which(command, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slurm_conf(root: Path, user: str, cpus: int) -> str:
    """Two nodes on this host, told apart by their slurmd's port; no munge (auth/none), no cgroups."""
    return f"""\
ClusterName=asyncrl-test
SlurmctldHost=localhost
SlurmctldPort={free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/none
CredType=cred/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
KillWait=5
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=node1 NodeAddr=127.0.0.1 Port={free_port()} CPUs={cpus} State=UNKNOWN
NodeName=node2 NodeAddr=127.0.0.1 Port={free_port()} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def wait_until(condition, timeout: float, what: str, poll: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(poll)


@pytest.fixture(scope="module")
def slurm(request, tmp_path_factory) -> Iterator[dict[str, str]]:
    """A running two-node Slurm; yields the environment its commands need (SLURM_CONF)."""
    if "slurm" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in: run `pytest -m slurm` (setup: docs/clusters.md)")
    missing = [command for command in COMMANDS if find(command) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found; install Slurm first: {SETUP}")
    root = tmp_path_factory.mktemp("slurm")
    (root / "state").mkdir()
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, getpass.getuser(), max(2, os.cpu_count() or 2)))
    env = {**os.environ, "SLURM_CONF": str(conf), "OMP_NUM_THREADS": "1"}
    commands = [["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", "node1"], ["slurmd", "-D", "-N", "node2"]]
    log = subprocess.DEVNULL  # each daemon writes its own log file under `root`
    daemons = [
        subprocess.Popen([find(name), *flags, "-f", str(conf)], env=env, stdout=log, stderr=subprocess.STDOUT)
        for name, *flags in commands
    ]

    def idle() -> bool:
        return run(env, "sinfo", "--noheader", "--Node", "--format=%T").split() == ["idle", "idle"]

    try:
        wait_until(idle, 60, f"two idle Slurm nodes (see {root}/*.log)")
        yield env
    finally:
        subprocess.run([find("scancel"), "--user", getpass.getuser()], env=env, timeout=30)
        try:
            wait_until(lambda: not run(env, "squeue", "--noheader").strip(), 60, "the jobs to end")
        finally:
            for daemon in daemons:
                daemon.terminate()
            for daemon in daemons:
                try:
                    daemon.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()


def run(env: dict[str, str], *command: str) -> str:
    result = subprocess.run([find(command[0]), *command[1:]], capture_output=True, text=True, env=env, timeout=60)
    return result.stdout if result.returncode == 0 else ""


def job_state(env: dict[str, str], job: str) -> str:
    found = re.search(r"JobState=(\w+)", run(env, "scontrol", "show", "job", job, "--oneliner"))
    return found.group(1) if found else "GONE"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny"
    init_model(path, "tiny")
    return path


def submit(env: dict[str, str], model: Path, run_dir: Path, *extra: str, port: int | None = None) -> str:
    """`asyncrl slurm --submit` for a tiny CPU run: node 1 trains, node 2 serves with two servers (on `port` and
    the next; default: a free one). The job's own log goes next to the run folder (Slurm's default is the
    working directory)."""
    # Servers on port and port + 1, the trainer's rendezvous on a third: two free_port() calls may return the
    # same port, and then the server and the rendezvous race for it.
    port = port or free_port()
    rendezvous_port = free_port()
    while rendezvous_port in (port, port + 1):
        rendezvous_port = free_port()
    argv = [
        "--model.name", str(model), "--output-dir", str(run_dir), "--seq-len", "128", "--orchestrator.batch-size",
        "32", "--orchestrator.group-size", "8", "--orchestrator.sampling.max-tokens", "12",
        "--orchestrator.environments.reverse_text.advantage.std-normalize", "true", "--trainer.optim.lr", "1e-2",
        "--deployment.inference-threads", "1", "--deployment.trainer-threads", "1", "--inference.port",
        str(port), "--cluster.replicas-per-node", "2", "--cluster.rendezvous-port", str(rendezvous_port),
        "--cluster.slurm.sbatch", f'["--output={run_dir.parent}/slurm-%j.out"]', *extra,
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "asyncrl", "slurm", *argv, "--submit"], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    [job] = re.findall(r"Submitted batch job (\d+)", result.stdout)
    return job


def trained_steps(run_dir: Path) -> int:
    return max(by_source(run_dir, "trainer"), default=0) if (run_dir / "metrics.jsonl").exists() else 0


def test_the_sbatch_script_runs_the_job_learns_and_a_requeued_job_resumes(slurm, tiny_model, tmp_path):
    """The run "learns": the reverse_text reward of a randomly initialised tiny model at least doubles, from about 0.03
    over the first 5 steps, as it learns which bytes answers are made of."""
    run_dir = tmp_path / "run"
    job = submit(slurm, tiny_model, run_dir, "--max-steps", str(STEPS), "--ckpt.interval", "5")
    wait_until(lambda: trained_steps(run_dir) >= 12, 240, "trainer step 12")
    subprocess.run([find("scontrol"), "requeue", job], env=slurm, check=True)
    # Slurm holds a requeued job back for a while; let it start at once.
    wait_until(lambda: job_state(slurm, job) == "PENDING", 60, "the requeued job to be pending")
    subprocess.run([find("scontrol"), "update", f"JobId={job}", "StartTime=now"], env=slurm, check=True)
    wait_until(lambda: job_state(slurm, job) in ("COMPLETED", "FAILED", "CANCELLED", "GONE"), 300, "the job to end")

    batch_log = (tmp_path / f"slurm-{job}.out").read_text()
    assert job_state(slurm, job) == "COMPLETED", batch_log
    # The job is requeued after trainer step 12; the checkpoint it resumes from depends on how far the trainer got
    # before Slurm stopped it (a slow host saw step 15 written first), but it is one of this run's, short of the end.
    resumed = re.search(r"resuming .* from checkpoint step (\d+)", batch_log)
    assert resumed and int(resumed[1]) in range(5, STEPS, 5), batch_log
    trainer, orchestrator = by_source(run_dir, "trainer"), by_source(run_dir, "orchestrator")
    assert sorted(trainer) == sorted(orchestrator) == list(range(1, STEPS + 1))
    rewards = [orchestrator[n]["reward/mean"] for n in range(1, STEPS + 1)]
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-10:])
    assert last > 2 * first and last > first + 0.03, f"reward did not rise: {rewards}"
    assert all(sum(o[f"perf/server/{i}/tokens_per_s"] for o in orchestrator.values()) > 0 for i in (0, 1))
    logs = sorted(p.name for p in (run_dir / "logs").glob("*.log"))
    host = socket.gethostname().split(".")[0]  # both nodes are this host, and %N names a node by its hostname
    assert logs == [f"{role}-{host}.log" for role in ("inference_0", "inference_1", "orchestrator", "trainer")]
    assert (run_dir / "logs" / "trainer" / "rank_0.log").exists()


def test_scancel_stops_every_process_of_the_job(slurm, tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    job = submit(slurm, tiny_model, run_dir, "--max-steps", "1000")
    wait_until(lambda: trained_steps(run_dir) >= 2, 240, "trainer step 2")
    subprocess.run([find("scancel"), job], env=slurm, check=True)
    wait_until(lambda: job_state(slurm, job) in ("CANCELLED", "GONE"), 60, "the job to be cancelled")

    def of_this_job() -> list[str]:
        names = []
        for process in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(process.info["cmdline"] or [])
            if str(run_dir) in cmdline:
                names.append(cmdline)
        return names

    wait_until(lambda: not of_this_job(), 60, "every process of the job to end")


def test_a_server_that_cannot_start_stops_the_job_and_the_job_says_why(slurm, tiny_model, tmp_path):
    """Server 0's port is taken: it exits at once, the inference step ends with it (--kill-on-bad-exit), and the
    job fails within seconds, naming the role, instead of running on without that server."""
    run_dir = tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        job = submit(slurm, tiny_model, run_dir, "--max-steps", "1000", port=port)
        wait_until(lambda: job_state(slurm, job) in ("FAILED", "GONE"), 120, "the job to fail")
    assert "asyncrl: inference exited with code" in (tmp_path / f"slurm-{job}.out").read_text()
    [server_log] = (run_dir / "logs").glob("inference_0-*.log")
    assert f"port {port} on 0.0.0.0 is in use" in server_log.read_text()
    assert trained_steps(run_dir) == 0
