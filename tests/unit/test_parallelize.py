"""`parallelize`: activation checkpointing and CPU offload change memory, never the numbers or the weight names."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config.schema import ModelConfig, OptimConfig, PerfConfig
from asyncrl.models import init_model
from asyncrl.trainer.distributed import close_distributed, init_distributed
from asyncrl.trainer.logprobs import compute_logprobs
from asyncrl.trainer.model import clip_grad_norm, full_state_dict, make_optimizer, parallelize, setup_model


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    init_model(path, "tiny")
    world = init_distributed("cpu", 1, seed=0)
    yield world, str(path)
    close_distributed()


def one_step(world_and_model, perf: PerfConfig) -> tuple[float, float, dict[str, torch.Tensor]]:
    """Loss, gradient norm and weights after one AdamW step on a packed row of three samples."""
    world, name = world_and_model
    torch.manual_seed(0)
    model = parallelize(setup_model(ModelConfig(name=name), world.device, perf), 1, world.device, "float32", perf)
    optimizer = make_optimizer(model, OptimConfig(lr=1e-3))
    input_ids = torch.randint(0, 259, (48,))
    position_ids = torch.cat([torch.arange(n) for n in (16, 12, 20)])
    logprobs, _ = compute_logprobs(model, input_ids, position_ids, 0.8, chunk_size=16)
    loss = -logprobs.sum()
    loss.backward()
    grad_norm = clip_grad_norm(model, 1.0)
    optimizer.step()
    return float(loss), grad_norm, full_state_dict(model)


@pytest.mark.parametrize(
    "perf",
    [
        PerfConfig(activation_checkpointing="selective"),
        PerfConfig(activation_checkpointing="full"),
        PerfConfig(cpu_offload=True),
    ],
    ids=["selective", "full", "cpu_offload"],
)
def test_memory_settings_give_the_same_step_and_weight_names(world, perf):
    loss, grad_norm, weights = one_step(world, PerfConfig())
    other_loss, other_grad_norm, other_weights = one_step(world, perf)
    assert other_loss == pytest.approx(loss, rel=1e-6)
    assert other_grad_norm == pytest.approx(grad_norm, rel=1e-5)
    assert other_weights.keys() == weights.keys()
    assert "model.layers.1.self_attn.q_proj.weight" in weights and "lm_head.weight" in weights
    for name in weights:
        torch.testing.assert_close(other_weights[name], weights[name], rtol=1e-5, atol=1e-7, msg=name)
