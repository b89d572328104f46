"""Weight broadcast between real processes over loopback (gloo on CPU: the same code as nccl on GPUs), and
its colocated form (buffers lent in shared memory on a CPU, by CUDA IPC on a GPU): trainer rank 0 and every
inference server in one group, state dicts arrive whole and bit-identical at each server, a receiver keeps
the newest version, a missing peer is a clear timeout, and real `asyncrl rl` runs serve each version they
receive, with one server and with two."""

from __future__ import annotations

import inspect
import socket
import subprocess
import sys
import time

import pytest
import torch
from rl_runs import by_source, policy_kl, run_rl  # tests/integration, on sys.path under pytest
from safetensors.torch import save_file

from asyncrl.config.schema import WeightTransferConfig
from asyncrl.errors import AsyncRLError
from asyncrl.models.offline import init_model
from asyncrl.transport import weights
from asyncrl.transport.broadcast import WeightReceiver, WeightSender
from asyncrl.transport.waiting import PeerTimeout

pytestmark = pytest.mark.integration


def state_dict(version: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes and shapes, different for every version."""
    generator = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(7, 5, generator=generator),
        "layer.norm": torch.randn(5, generator=generator).to(torch.bfloat16),
        "layer.proj": torch.randn(3, 5, generator=generator).to(torch.bfloat16),
        "steps": torch.tensor([version, 2 * version]),
    }


def adapter() -> dict[str, torch.Tensor]:
    """A rank-1 LoRA adapter of a layer `layer` with a [3, 2] weight."""
    return {
        "base_model.model.layer.lora_A.weight": torch.tensor([[1.0, 2.0]]),
        "base_model.model.layer.lora_B.weight": torch.tensor([[1.0], [0.0], [-1.0]]),
    }


# Trainer rank 0 in a process of its own; it builds the same tensors from the functions above.
SENDER = f"""
import sys, torch
from asyncrl.config.schema import WeightTransferConfig
from asyncrl.errors import AsyncRLError
from asyncrl.transport.broadcast import WeightSender
{inspect.getsource(state_dict)}
{inspect.getsource(adapter)}
mode, device = sys.argv[4], torch.device(sys.argv[5])
transfer = WeightTransferConfig(mode=mode, port=int(sys.argv[1]), receivers=int(sys.argv[3]), timeout=60)
sender = WeightSender(transfer, device)
for version in (1, 2, 3):
    sender.send({{k: v.to(device) for k, v in state_dict(version).items()}}, version)
sys.stdin.readline()  # then, when told: the adapter, of the base model in folder argv[2]
sender.send(adapter(), 4, {{"r": 1, "lora_alpha": 2.0, "base_model_name_or_path": sys.argv[2]}})
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def receiver_config(
    port: int, rank: int = 1, receivers: int = 1, timeout: float = 60, mode: str = "broadcast"
) -> WeightTransferConfig:
    return WeightTransferConfig(mode=mode, port=port, rank=rank, receivers=receivers, timeout=timeout)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")


@pytest.mark.parametrize(
    ("mode", "device", "servers"),
    [
        ("broadcast", "cpu", 1),
        ("broadcast", "cpu", 2),
        ("colocated", "cpu", 1),
        ("colocated", "cpu", 2),
        pytest.param("colocated", "cuda:0", 2, marks=needs_gpu),
    ],
)
def test_every_receiver_keeps_the_newest_version_whole_and_merges_adapters(tmp_path, mode, device, servers):
    save_file({"layer.weight": torch.ones(3, 2), "norm.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    port = free_port()
    # The servers start first, as under `asyncrl rl`: they wait for trainer rank 0 to open the group.
    receivers = [
        WeightReceiver(receiver_config(port, rank, servers, mode=mode), torch.device(device))
        for rank in range(1, servers + 1)
    ]
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(port), str(tmp_path), str(servers), mode, device],
        stdin=subprocess.PIPE,
        # A file, not a pipe: torch's shared-memory manager, the sender's child, holds its stderr open while
        # the receivers hold the buffers it lent.
        stderr=open(tmp_path / "sender.log", "wb"),
    )
    try:
        for receiver in receivers:
            received, version = receiver.take(3, timeout=120)
            assert version == 3
            expected = state_dict(3)
            assert list(received) == list(expected)
            for name, tensor in expected.items():
                assert received[name].device == torch.device(device), name
                assert received[name].dtype == tensor.dtype and torch.equal(received[name].cpu(), tensor), name
            # An older version asked for: the newest one is what the receiver has.
            assert receiver.take(1, timeout=1)[1] == 3
        with pytest.raises(PeerTimeout, match="version 4 did not arrive from trainer rank 0 within 2s"):
            receivers[0].take(4, timeout=2)

        sender.communicate(b"go\n", timeout=60)
        assert sender.returncode == 0, (tmp_path / "sender.log").read_text()
        for receiver in receivers:
            received, version = receiver.take(4, timeout=60)
            assert version == 4 and sorted(received) == ["layer.weight", "norm.weight"]
            # W + (alpha / r) * B @ A
            expected = torch.ones(3, 2) + 2.0 * torch.tensor([[1.0, 2.0], [0.0, 0.0], [-1.0, -2.0]])
            torch.testing.assert_close(received["layer.weight"], expected)
    finally:
        sender.kill()
        for receiver in receivers:
            receiver.stop()


def test_missing_trainer_times_out_naming_it():
    port = free_port()  # nobody listens there
    receiver = WeightReceiver(receiver_config(port, timeout=1), torch.device("cpu"))
    start = time.monotonic()
    with pytest.raises(PeerTimeout, match=rf"trainer rank 0 did not open the group at 127\.0\.0\.1:{port} within 1s"):
        receiver.take(1, timeout=60)
    assert time.monotonic() - start < 30
    receiver.stop()


def test_missing_inference_server_times_out_naming_it():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(PeerTimeout, match=rf"inference server 2 of 2 did not join at 127\.0\.0\.1:{port} within 1s"):
        config = WeightTransferConfig(mode="broadcast", port=port, receivers=2, timeout=1)
        receiver = WeightReceiver(receiver_config(port, 1, 2, timeout=30), torch.device("cpu"))
        try:
            WeightSender(config, torch.device("cpu"))
        finally:
            receiver.stop()
    assert time.monotonic() - start < 30


def test_a_server_with_no_place_in_the_group_is_refused():
    with pytest.raises(
        AsyncRLError, match=r"weight_transfer.rank = 3 is not one of the group's inference servers 1..2"
    ):
        WeightReceiver(receiver_config(free_port(), rank=3, receivers=2), torch.device("cpu"))


def test_colocated_servers_must_share_trainer_rank_0s_device():
    from asyncrl.transport.broadcast import WeightSender

    trainer = {"host": "node-a", "gpu": "GPU-1"}
    assert WeightSender._backend("colocated", trainer, [dict(trainer), dict(trainer)]) == "shared"
    with pytest.raises(AsyncRLError, match="inference server 2 is on GPU GPU-2 of node-a"):
        WeightSender._backend("colocated", trainer, [dict(trainer), {"host": "node-a", "gpu": "GPU-2"}])
    with pytest.raises(AsyncRLError, match="use weight_transfer.mode = 'colocated' there"):
        WeightSender._backend("broadcast", trainer, [dict(trainer)])

    from asyncrl.config import load
    from asyncrl.config.schema import RLConfig
    from asyncrl.run_setup import resolve

    argv = ["--weight-transfer.mode", "colocated", "--deployment.inference-device", "cuda:0",
            "--deployment.trainer-device", "cuda:1"]  # fmt: skip
    cfg, _ = load(RLConfig, argv)
    with pytest.raises(AsyncRLError, match=r"trainer rank 0's device \(cuda:1\), but replica 0 on cuda:0"):
        resolve(cfg, gpus=2)


@pytest.mark.parametrize(("mode", "servers"), [("broadcast", 1), ("broadcast", 2), ("colocated", 1)])
def test_rl_run_with_broadcast_serves_each_new_version(tmp_path, mode, servers):
    """A real `asyncrl rl`, lockstep: every server must serve version n - 1 for batch n, received by broadcast
    (or lent in shared memory, colocated)."""
    init_model(tmp_path / "base", "tiny")
    result = run_rl(
        tmp_path / "base", tmp_path / "run", "--weight-transfer.mode", mode,
        "--deployment.inference-replicas", str(servers),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    orchestrator, trainer = by_source(tmp_path / "run", "orchestrator"), by_source(tmp_path / "run", "trainer")
    assert [orchestrator[n]["policy_version"] for n in (1, 2, 3)] == [0, 1, 2]
    for name in ["inference"] if servers == 1 else ["inference_0", "inference_1"]:
        assert "trainer rank 0 joined" in (tmp_path / "run" / "logs" / f"{name}.log").read_text()
    # Versions 1 and 2 went by broadcast only; the last one is also written in full.
    for version in (1, 2):
        assert [p.name for p in weights.weights_dir(tmp_path / "run", version).iterdir()] == ["STABLE"]
    final = weights.load_state_dict(weights.weights_dir(tmp_path / "run", 3))
    # The trainer and inference held the same weights at every step, while those weights moved away from the
    # base model by far more than their mismatch: inference served the broadcast weights, not stale ones.
    assert max(t["mismatch_kl"] for t in trainer.values()) < 1e-4
    assert policy_kl(tmp_path / "base", final) > 1e-3


def test_update_without_broadcast_needs_a_folder_with_weights(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from asyncrl.config.schema import InferenceConfig
    from asyncrl.inference.api.server import create_app
    from asyncrl.inference.backends.native_backend import NativeBackend
    from asyncrl.inference.engine.engine import Engine

    init_model(tmp_path / "base", "tiny")
    monkeypatch.setenv("ASYNCRL_ADMIN_TOKEN", "token")
    cfg = InferenceConfig(model={"name": str(tmp_path / "base")}, device="cpu", num_threads=1)
    engine = Engine(cfg)
    try:
        http = TestClient(create_app(NativeBackend(engine), cfg))
        admin = {"Authorization": "Bearer token"}
        response = http.post("/admin/update_weights", json={"version": 1}, headers=admin)
        assert response.status_code == 400 and "receives no weight broadcast" in response.json()["error"]["message"]
        marker_only = weights.publish_marker(tmp_path / "run", 1)  # what a broadcast run leaves on disk
        response = http.post("/admin/update_weights", json={"path": str(marker_only), "version": 1}, headers=admin)
        assert response.status_code == 400 and "sent by broadcast" in response.json()["error"]["message"]
        assert engine.policy_version == 0
    finally:
        engine.stop()


def test_asyncrl_rl_puts_trainer_and_every_server_in_one_group_on_a_free_port():
    from asyncrl.config import load
    from asyncrl.config.schema import RLConfig
    from asyncrl.run_setup import resolve

    cfg, _ = load(RLConfig, ["--weight-transfer.mode", "broadcast", "--deployment.inference-replicas", "3"])
    replicas, _, trainer = resolve(cfg)
    assert {r.weight_transfer.mode for r in replicas} == {trainer.weight_transfer.mode} == {"broadcast"}
    assert {r.weight_transfer.port for r in replicas} == {trainer.weight_transfer.port} != {0}
    assert [r.weight_transfer.rank for r in replicas] == [1, 2, 3]
    assert {r.weight_transfer.receivers for r in replicas} == {trainer.weight_transfer.receivers} == {3}


def test_broadcast_with_the_vllm_backend_is_refused_when_the_config_loads():
    from asyncrl.config import ConfigError, load
    from asyncrl.config.schema import RLConfig

    with pytest.raises(ConfigError, match="broadcast' needs inference.backend = 'native'"):
        load(RLConfig, ["--weight-transfer.mode", "broadcast", "--inference.backend", "vllm"])
