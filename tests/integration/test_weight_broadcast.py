"""Weight broadcast between two real processes over loopback (gloo on CPU: the same code as nccl on GPUs):
state dicts arrive whole, the receiver keeps the newest version, a missing peer is a clear timeout, and a
real `asyncrl rl` run serves each version it receives."""

from __future__ import annotations

import inspect
import subprocess
import sys
import time

import pytest
import torch
from rl_runs import by_source, policy_kl, run_rl  # tests/integration, on sys.path under pytest
from safetensors.torch import save_file

from asyncrl.config.schema import WeightTransferConfig
from asyncrl.models import init_model
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
from asyncrl.transport.broadcast import WeightSender
{inspect.getsource(state_dict)}
{inspect.getsource(adapter)}
sender = WeightSender(WeightTransferConfig(mode="broadcast", port=int(sys.argv[1]), timeout=60), torch.device("cpu"))
for version in (1, 2, 3):
    sender.send(state_dict(version), version)
sys.stdin.readline()  # then, when told: the adapter, of the base model in folder argv[2]
sender.send(adapter(), 4, {{"r": 1, "lora_alpha": 2.0, "base_model_name_or_path": sys.argv[2]}})
"""


def test_receiver_keeps_the_newest_version_whole_and_merges_adapters(tmp_path):
    save_file({"layer.weight": torch.ones(3, 2), "norm.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    receiver = WeightReceiver(WeightTransferConfig(mode="broadcast", port=0, timeout=60), torch.device("cpu"))
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(receiver.port), str(tmp_path)], stdin=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        received, version = receiver.take(3, timeout=120)
        assert version == 3
        expected = state_dict(3)
        assert list(received) == list(expected)
        for name, tensor in expected.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
        # An older version asked for: the newest one is what the receiver has.
        assert receiver.take(1, timeout=1)[1] == 3
        with pytest.raises(PeerTimeout, match="version 4 did not arrive from trainer rank 0 within 2s"):
            receiver.take(4, timeout=2)

        sender.communicate(b"go\n", timeout=60)
        assert sender.returncode == 0, sender.stderr
        received, version = receiver.take(4, timeout=60)
        assert version == 4 and sorted(received) == ["layer.weight", "norm.weight"]
        # W + (alpha / r) * B @ A
        expected = torch.ones(3, 2) + 2.0 * torch.tensor([[1.0, 2.0], [0.0, 0.0], [-1.0, -2.0]])
        torch.testing.assert_close(received["layer.weight"], expected)
    finally:
        sender.kill()
        receiver.stop()


def test_missing_trainer_times_out_naming_it():
    receiver = WeightReceiver(WeightTransferConfig(mode="broadcast", port=0, timeout=1), torch.device("cpu"))
    start = time.monotonic()
    with pytest.raises(PeerTimeout, match=r"trainer rank 0 did not join at 127\.0\.0\.1:\d+ within 1s"):
        receiver.take(1, timeout=60)
    assert time.monotonic() - start < 30
    receiver.stop()


def test_missing_inference_server_times_out_naming_it():
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(PeerTimeout, match=rf"could not reach the inference process at 127\.0\.0\.1:{port} within 1s"):
        WeightSender(WeightTransferConfig(mode="broadcast", port=port, timeout=1), torch.device("cpu"))
    assert time.monotonic() - start < 30


def test_rl_run_with_broadcast_serves_each_new_version(tmp_path):
    """A real `asyncrl rl`, lockstep: inference must serve version n - 1 for batch n, received by broadcast."""
    init_model(tmp_path / "base", "tiny")
    result = run_rl(tmp_path / "base", tmp_path / "run", "--weight-transfer.mode", "broadcast")
    assert result.returncode == 0, result.stdout + result.stderr
    orchestrator, trainer = by_source(tmp_path / "run", "orchestrator"), by_source(tmp_path / "run", "trainer")
    assert [orchestrator[n]["policy_version"] for n in (1, 2, 3)] == [0, 1, 2]
    assert "trainer rank 0 joined" in (tmp_path / "run" / "logs" / "inference.log").read_text()
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
    from asyncrl.inference.engine import Engine
    from asyncrl.inference.server import create_app

    init_model(tmp_path / "base", "tiny")
    monkeypatch.setenv("ASYNCRL_ADMIN_TOKEN", "token")
    cfg = InferenceConfig(model={"name": str(tmp_path / "base")}, device="cpu", num_threads=1)
    engine = Engine(cfg)
    try:
        http = TestClient(create_app(engine, cfg))
        admin = {"Authorization": "Bearer token"}
        response = http.post("/admin/update_weights", json={"version": 1}, headers=admin)
        assert response.status_code == 400 and "receives no weight broadcast" in response.json()["error"]["message"]
        marker_only = weights.publish_marker(tmp_path / "run", 1)  # what a broadcast run leaves on disk
        response = http.post("/admin/update_weights", json={"path": str(marker_only), "version": 1}, headers=admin)
        assert response.status_code == 400 and "sent by broadcast" in response.json()["error"]["message"]
        assert engine.policy_version == 0
    finally:
        engine.stop()


def test_asyncrl_rl_gives_trainer_and_inference_one_free_broadcast_port():
    from asyncrl.config import load
    from asyncrl.config.schema import RLConfig
    from asyncrl.launcher import resolve

    cfg, _ = load(RLConfig, ["--weight-transfer.mode", "broadcast"])
    inference, _, trainer = resolve(cfg)
    assert trainer.weight_transfer.mode == inference.weight_transfer.mode == "broadcast"
    assert trainer.weight_transfer.port == inference.weight_transfer.port != 0


def test_broadcast_with_the_vllm_backend_is_refused_when_the_config_loads():
    from asyncrl.config import ConfigError, load
    from asyncrl.config.schema import RLConfig

    with pytest.raises(ConfigError, match="broadcast' needs inference.backend = 'native'"):
        load(RLConfig, ["--weight-transfer.mode", "broadcast", "--inference.backend", "vllm"])
