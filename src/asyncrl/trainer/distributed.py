"""The process group of the trainer: one rank per process, from torchrun's environment or a world of one.

Without torchrun the trainer still opens a (one-rank) process group, on an in-memory store, so that RL,
SFT and tests run the very same collectives for 1 and N ranks. Backend: nccl on GPU, gloo on CPU.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from asyncrl.cpu_threads import threads_per_process
from asyncrl.errors import AsyncRLError
from asyncrl.loading import resolve_device


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str, num_threads: int, seed: int) -> World:
    """Join (or create) the process group, pick this rank's device, set threads (0: this rank's share of the
    cores) and seeds."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch_device = resolve_device(device, local_rank)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    # 0: this rank's share of the machine's cores, not torch's default of all of them in every rank.
    torch.set_num_threads(num_threads or threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", 1))))

    backend = "nccl" if torch_device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if under_torchrun:
            dist.init_process_group(backend, device_id=torch_device if backend == "nccl" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    # Every rank starts from the same weights (loaded from disk) and the same random state.
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return World(rank, world_size, local_rank, torch_device)


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (in place on a copy); the identity for a world of one."""
    values = values.clone()
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def max_over_ranks(count: int, device: torch.device) -> int:
    value = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value)


def check_same_count(count: int, what: str, device: torch.device) -> None:
    """FSDP collectives hang unless every rank runs the same number of forward/backward passes."""
    most, fewest = max_over_ranks(count, device), -max_over_ranks(-count, device)
    if most != fewest:
        raise AsyncRLError(
            f"trainer ranks disagree on the number of {what} ({fewest} to {most}); every rank's rollout file "
            "must hold the same number of micro-batches (the orchestrator pads with fully masked rows)"
        )


def close_distributed(timeout_s: float = 60.0) -> None:
    """Leave the process group. On gloo every rank first meets the others (at most `timeout_s`): a rank that
    tears its connections down while a peer still works on its last collective can abort that peer's
    process at exit ("terminate called without an active exception")."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
        except RuntimeError:
            pass  # a peer died or stalled: leave anyway, its own error says why
    dist.destroy_process_group()
