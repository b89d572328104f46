"""Rollout batches on disk: `rollouts/step_N/rank_R.safetensors`, one per trainer rank and step.

A file holds a list of micro-batches; each is one packed row of at most `seq_len` tokens with these
per-token streams (all 1-D, same length):

    input_ids (int64), position_ids (int64, restart at 0 per sample), loss_mask (bool),
    advantages (float32), inference_logprobs (float32), temperature (float32)

plus `sample_lengths` (int64, one entry per packed sample), and for mixture-of-experts policies whose
rollouts carry their routing, `routed_experts` (int16 [T, MoE layers, k]: the experts the inference engine
routed each token to, -1 where none was recorded). Written under a temporary name and renamed, so a reader
never sees half a file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file

from asyncrl.transport.waiting import wait_for
from asyncrl.write_errors import save_tensors


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    inference_logprobs: torch.Tensor
    temperature: torch.Tensor
    sample_lengths: torch.Tensor
    routed_experts: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


STREAMS = [f.name for f in fields(MicroBatch) if f.name != "routed_experts"]
OPTIONAL_STREAMS = ["routed_experts"]


def step_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "rollouts" / f"step_{step}"


def rank_file(output_dir: Path, step: int, rank: int) -> Path:
    return step_dir(output_dir, step) / f"rank_{rank}.safetensors"


def write_batch(path: Path, micro_batches: list[MicroBatch], metadata: dict | None = None) -> None:
    tensors = {}
    for i, mb in enumerate(micro_batches):
        for name in STREAMS + OPTIONAL_STREAMS:
            if getattr(mb, name) is not None:
                tensors[f"{i}.{name}"] = getattr(mb, name).contiguous()
    meta = {"num_micro_batches": str(len(micro_batches)), "extra": json.dumps(metadata or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_tensors(tensors, tmp, metadata=meta)
    os.replace(tmp, path)


def read_batch(path: Path) -> list[MicroBatch]:
    tensors = load_file(path)
    count = 1 + max((int(k.split(".", 1)[0]) for k in tensors), default=-1)
    return [
        MicroBatch(**{name: tensors[f"{i}.{name}"] for name in STREAMS + OPTIONAL_STREAMS if f"{i}.{name}" in tensors})
        for i in range(count)
    ]


def wait_for_batch(output_dir: Path, step: int, rank: int, timeout: float, alive=None) -> list[MicroBatch]:
    """Block until the orchestrator has written this rank's batch of `step`, then read it."""
    path = rank_file(output_dir, step, rank)
    wait_for(path.exists, timeout, f"rollout batch {path}", "is the orchestrator running?", alive=alive)
    return read_batch(path)
