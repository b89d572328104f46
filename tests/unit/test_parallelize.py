"""`parallelize`: activation checkpointing, CPU offload and FSDP2 units change memory, never the numbers or the
weight names."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from asyncrl.config.schema import ModelConfig, OptimConfig, PerfConfig
from asyncrl.errors import AsyncRLError
from asyncrl.models.offline import init_model
from asyncrl.trainer.distributed import close_distributed, init_distributed
from asyncrl.trainer.logprobs import compute_logprobs
from asyncrl.trainer.model import (
    clip_grad_norm,
    decoder_layers,
    full_state_dict,
    make_optimizer,
    parallelize,
    setup_model,
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    init_model(path, "tiny")
    world = init_distributed("cpu", 1, seed=0)
    yield world, str(path)
    close_distributed()


def parallelized(world_and_model, perf: PerfConfig):
    world, name = world_and_model
    return parallelize(setup_model(ModelConfig(name=name), world.device, perf), 1, world.device, "float32", perf)


def train_steps(world_and_model, perf: PerfConfig, steps: int = 3) -> tuple[list[float], list[float], dict]:
    """Losses, gradient norms and weights after `steps` AdamW steps on packed rows of three samples."""
    torch.manual_seed(0)
    model = parallelized(world_and_model, perf)
    optimizer = make_optimizer(model, OptimConfig(lr=1e-3))
    position_ids = torch.cat([torch.arange(n) for n in (16, 12, 20)])
    losses, grad_norms = [], []
    for _ in range(steps):
        logprobs, _ = compute_logprobs(model, torch.randint(0, 259, (48,)), position_ids, 0.8, chunk_size=16)
        loss = -logprobs.sum()
        loss.backward()
        grad_norms.append(clip_grad_norm(model, 1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grad_norms, full_state_dict(model)


@pytest.mark.parametrize(
    "perf",
    [
        PerfConfig(activation_checkpointing="selective"),
        PerfConfig(activation_checkpointing="full"),
        PerfConfig(cpu_offload=True),
        PerfConfig(fsdp_unit="layer"),
    ],
    ids=["selective", "full", "cpu_offload", "fsdp_unit_layer"],
)
def test_memory_settings_give_the_same_steps_and_weight_names(world, perf):
    losses, grad_norms, weights = train_steps(world, PerfConfig(fsdp_unit="model"))
    other_losses, other_grad_norms, other_weights = train_steps(world, perf)
    assert other_losses == pytest.approx(losses, rel=1e-6)
    assert other_grad_norms == pytest.approx(grad_norms, rel=1e-5)
    assert other_weights.keys() == weights.keys()
    assert "model.layers.1.self_attn.q_proj.weight" in weights and "lm_head.weight" in weights
    for name in weights:
        torch.testing.assert_close(other_weights[name], weights[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    ("perf", "layers_are_units"),
    [
        (PerfConfig(), False),
        (PerfConfig(fsdp_unit="model"), False),
        (PerfConfig(fsdp_unit="layer"), True),
        (PerfConfig(cpu_offload=True), True),
    ],
    ids=["auto", "model", "layer", "auto_cpu_offload"],
)
def test_fsdp_unit_shards_each_decoder_layer_or_the_root_only(world, perf, layers_are_units):
    model = parallelized(world, perf)
    assert isinstance(model, FSDPModule)
    layers = decoder_layers(model)
    assert len(layers) == 2 and all(isinstance(layer, FSDPModule) == layers_are_units for layer in layers)


def test_clipping_scales_gradients_over_the_limit_and_leaves_the_rest_untouched():
    model = torch.nn.Linear(4, 3)
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 0.5)
    before = [parameter.grad.clone() for parameter in model.parameters()]
    norm = 0.5 * (15**0.5)
    assert clip_grad_norm(model, 10.0) == pytest.approx(norm)
    for parameter, grad in zip(model.parameters(), before, strict=True):
        assert torch.equal(parameter.grad, grad)
    assert clip_grad_norm(model, 1.0) == pytest.approx(norm)
    total = torch.cat([parameter.grad.flatten() for parameter in model.parameters()]).norm()
    assert float(total) == pytest.approx(1.0, rel=1e-5)


def test_clipping_refuses_gradients_fsdp2_did_not_reduce(world):
    """Where FSDP2's backward hooks do not run (torch 2.11 with a forward returning a dataclass), the gradients
    sit on the gathered parameters and the optimizer, which holds the shards, would change nothing: refused."""
    model = parallelized(world, PerfConfig(fsdp_unit="model"))
    model.unshard()  # the gathered parameters, as a forward leaves them
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    with pytest.raises(AsyncRLError, match="FSDP2 did not reduce the gradients"):
        clip_grad_norm(model, 1.0)
