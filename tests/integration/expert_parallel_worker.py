"""One trainer rank of `test_expert_parallel.py` (run under torchrun): two RL steps of a tiny mixture-of-experts
model through the trainer's own code (`parallelize`, `train_step`, `clip_grad_norm`, AdamW), with `trainer.ep`
from the command line. Rank 0 writes each step's loss, routing metrics, full gradients and the weights after
the last step to the given folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from asyncrl.config.schema import LossConfig, ModelConfig, OptimConfig, PerfConfig, TrainerConfig
from asyncrl.trainer.bench import random_row
from asyncrl.trainer.distributed import close_distributed, init_distributed
from asyncrl.trainer.model import clip_grad_norm, full_state_dict, make_optimizer, parallelize, setup_model
from asyncrl.trainer.rl import train_step


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (a collective)."""
    grads = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    return grads


class Recorder:
    """Trains steps through the trainer's own code and keeps what the tests compare: each step's metrics (with
    the gradient norm) and full gradients, then the weights after the last step, saved by rank 0."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainerConfig, world):
        self.model, self.optimizer, self.cfg, self.world = model, optimizer, cfg, world
        self.steps: list[dict] = []
        self.tensors: dict[str, torch.Tensor] = {}

    def step(self, name: str, micro_batches: list) -> None:
        metrics = train_step(self.model, micro_batches, self.cfg, self.world)
        grads = full_gradients(self.model)
        metrics["grad_norm"] = clip_grad_norm(self.model, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps.append(metrics)
        self.tensors.update({f"{name}.grad.{key}": grad for key, grad in grads.items()})

    def save(self, output: Path, stem: str) -> None:
        weights = full_state_dict(self.model)  # a collective: every rank
        if self.world.is_main:
            self.tensors.update({f"weight.{key}": tensor for key, tensor in weights.items()})
            save_file({k: v.contiguous() for k, v in self.tensors.items()}, output / f"{stem}.safetensors")
            (output / f"{stem}.json").write_text(json.dumps(self.steps))


def main(model_name: str, ep: int, output: Path, activation_checkpointing: str) -> None:
    cfg = TrainerConfig(
        model=ModelConfig(name=model_name),
        seq_len=64,
        ep=ep,
        perf=PerfConfig(activation_checkpointing=activation_checkpointing),
        loss=LossConfig(router_aux_coef=0.01),
    )
    cfg.bench.documents = 4
    world = init_distributed("cpu", 1, seed=0)
    model = parallelize(
        setup_model(cfg.model, world.device, cfg.perf), world.world_size, world.device, "float32", cfg.perf, ep
    )
    optimizer = make_optimizer(model, OptimConfig(lr=1e-2))
    # Each rank its own rows (seeded by rank), the same whatever ep is.
    generator = torch.Generator().manual_seed(100 + world.rank)
    vocab = model.config.vocab_size
    recorder = Recorder(model, optimizer, cfg, world)
    for step in range(2):
        recorder.step(f"step{step}", [random_row(cfg, vocab, generator) for _ in range(2)])
    recorder.save(output, f"ep{ep}")
    del model, optimizer, recorder  # FSDP's process groups go before the group they were split from
    close_distributed()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
