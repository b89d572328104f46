"""A run laid out as on a cluster, on one host: each process started on its own from the configs
`asyncrl run-folder prepare` wrote, the orchestrator reaching the inference servers only by URL at this
host's address, the trainer over two torchrun agents. It learns. (Two trainer nodes of one rank computing
what one node of two ranks does: tests/integration/test_trainer.py.)"""

from __future__ import annotations

import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import psutil
import pytest
from rl_runs import by_source  # tests/integration, on sys.path under pytest

from asyncrl.models.offline import init_model

pytestmark = pytest.mark.integration


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_ports(count: int, host: str) -> int:
    """The first of `count` consecutive free ports (server i of a node listens on port + i)."""
    for _ in range(100):
        first = free_port(host)
        try:
            for port in range(first + 1, first + count):
                with socket.socket() as sock:
                    sock.bind((host, port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def host_address() -> str:
    """An address of this host that is not loopback, as another node would reach it; loopback if there is none."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return "127.0.0.1"


def environment(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny"
    init_model(path, "tiny")
    return path


RUN_STEPS = 30


def test_a_run_laid_out_over_nodes_learns_with_servers_reached_only_by_url(tmp_path, tiny_model):
    """As on a cluster of 3 nodes: an inference node with 2 servers, 2 trainer nodes of one rank each (static
    rendezvous, as the sbatch script and the manifests start them), the orchestrator beside trainer rank 0,
    and the weights broadcast from trainer rank 0 at this host's address. "Learns": the reverse_text reward
    of a randomly initialised tiny model at least doubles, from about 0.03 over the first 5 steps (it first
    learns which bytes answers are made of)."""
    address, run = host_address(), tmp_path / "run"
    port = free_ports(2, address)
    config = [
        "--model.name", str(tiny_model), "--output-dir", str(run), "--seq-len", "128", "--max-steps", str(RUN_STEPS),
        "--orchestrator.batch-size", "32", "--orchestrator.group-size", "8", "--orchestrator.sampling.max-tokens",
        "12", "--orchestrator.environments.reverse_text.advantage.std-normalize", "true", "--trainer.optim.lr",
        "1e-2", "--deployment.inference-threads", "1", "--deployment.trainer-threads", "1",
        "--cluster.trainer-nodes", "2", "--cluster.inference-nodes", "1", "--cluster.replicas-per-node", "2",
        "--inference.port", str(port), "--weight-transfer.mode", "broadcast", "--weight-transfer.timeout", "120",
        "--weight-transfer.port", str(free_port(address)), "--weight-transfer.host", address,
        "--orchestrator.inference-urls", f'["http://{address}:{port}", "http://{address}:{port + 1}"]',
    ]  # fmt: skip
    env = environment(
        ASYNCRL_RUN_TOKEN=secrets.token_hex(8), ASYNCRL_ADMIN_TOKEN="admin", ASYNCRL_API_KEY="key",
        ASYNCRL_RANK_LOG_DIR=str(run / "logs" / "trainer"),
    )  # fmt: skip
    asyncrl = [sys.executable, "-m", "asyncrl"]
    prepared = subprocess.run([*asyncrl, "run-folder", "prepare", *config], capture_output=True, text=True, env=env)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    # What every node runs next (all of them see this host's folder here).
    subprocess.run([*asyncrl, "run-folder", "check", str(run), "--timeout", "10"], env=env, check=True)

    def start(name: str, command: list[str]) -> subprocess.Popen:
        log = open(run / "logs" / f"{name}.log", "w")
        stack.callback(log.close)
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        stack.callback(stop, process)
        return process

    rendezvous = f"--rdzv-endpoint={address}:{free_port(address)}"
    with ExitStack() as stack:
        for i in range(2):
            start(f"inference_{i}", [*asyncrl, "inference", "@", str(run / "configs" / f"inference_{i}.toml")])
        trainer = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", rendezvous]
        trainer_args = ["-m", "asyncrl", "trainer", "@", str(run / "configs" / "trainer.toml")]
        agents = [start(f"trainer_node{n}", [*trainer, f"--node-rank={n}", *trainer_args]) for n in range(2)]
        orchestrator = start("orchestrator", [*asyncrl, "orchestrator", "@", str(run / "configs/orchestrator.toml")])
        deadline = time.monotonic() + 420
        for name, process in [*zip(("trainer_node0", "trainer_node1"), agents), ("orchestrator", orchestrator)]:
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert code == 0, f"{name} exited with {code}:\n" + (run / "logs" / f"{name}.log").read_text()[-3000:]
        # The servers listen beyond loopback: they served the orchestrator, which has the job's key, and no one else.
        url = f"http://{address}:{port}/v1/models"
        assert httpx.get(url, timeout=10).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer key"}, timeout=10).status_code == 200

    trained, orchestrator_metrics = by_source(run, "trainer"), by_source(run, "orchestrator")
    assert sorted(trained) == list(range(1, RUN_STEPS + 1))
    rewards = [orchestrator_metrics[n]["reward/mean"] for n in range(1, RUN_STEPS + 1)]
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-10:])
    assert last > 2 * first and last > first + 0.03, f"reward did not rise: {rewards}"
    # Both servers took groups, and every new version reached them by broadcast, not through the folder.
    assert all(sum(o[f"perf/server/{i}/tokens_per_s"] for o in orchestrator_metrics.values()) > 0 for i in (0, 1))
    assert orchestrator_metrics[RUN_STEPS]["server/1/policy_version"] >= RUN_STEPS - 2
    assert sorted(p.name for p in (run / "weights" / f"step_{RUN_STEPS - 1}").iterdir()) == ["STABLE"]
    assert (run / "logs" / "trainer" / "rank_1.log").exists()


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
