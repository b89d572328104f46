"""The trainer's part of a checkpoint: everything needed to continue training as if it had never stopped.

    checkpoints/step_N/trainer/
        state/              torch.distributed.checkpoint of the model and the AdamW state (sharded: each
                            rank writes its own shards; loads onto any number of ranks)
        rng/rank_R.json     Python, NumPy and torch generator states of rank R
        progress.json       the step and the data position
        MANIFEST.json       written last (asyncrl.checkpoints): sizes and checksums of all of the above

The learning rate is a function of the step (trainer/schedule.py), so the step is the scheduler's state.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from asyncrl import checkpoints
from asyncrl.errors import AsyncRLError
from asyncrl.trainer.distributed import World

PART = "trainer"


@dataclass
class TrainerProgress:
    step: int  # the last finished step; training continues at step + 1
    examples_drawn: int = 0  # SFT: examples taken from the training stream so far
    answer_tokens: int = 0  # SFT: answer (loss) tokens trained on so far, all ranks
    total_tokens: int = 0  # SFT: tokens of the rows trained on so far, all ranks


def save(
    output_dir: Path, progress: TrainerProgress, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World
) -> None:
    """A collective: every rank writes its shards and generator states; rank 0 seals the part."""
    staging = checkpoints.staging_dir(output_dir, progress.step, PART)
    if world.is_main:
        checkpoints.begin_part(output_dir, progress.step, PART)
    dist.barrier()
    (staging / "rng").mkdir(exist_ok=True)
    (staging / "rng" / f"rank_{world.rank}.json").write_text(json.dumps(_rng_state(world.device)))
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=staging / "state")
    if world.is_main:
        (staging / "progress.json").write_text(json.dumps(asdict(progress)))
        checkpoints.finish_part(output_dir, progress.step, PART)
    dist.barrier()


def resume(
    output_dir: Path,
    parts: tuple[str, ...],
    requested: int | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    world: World,
) -> TrainerProgress:
    """Load checkpoint `requested` (None: the newest whole one) into the sharded model and optimizer."""
    step = _resume_step(output_dir, parts, requested, world)
    path = checkpoints.part_dir(output_dir, step, PART)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path / "state")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    rng = path / "rng" / f"rank_{world.rank}.json"
    if rng.exists():  # a rank the saving run did not have keeps its seeded generators
        _set_rng_state(json.loads(rng.read_text()), world.device)
    if world.is_main:
        print(f"resumed from checkpoint {path}", flush=True)
    return TrainerProgress(**json.loads((path / "progress.json").read_text()))


def _resume_step(output_dir: Path, parts: tuple[str, ...], requested: int | None, world: World) -> int:
    """Rank 0 picks (and checksums) the checkpoint, the others follow; every rank raises the same error."""
    found: list = [None]
    if world.is_main:
        try:
            step, refused = checkpoints.find_resume_step(output_dir, parts, requested)
            for line in refused:
                print(f"{line}; trying an older one", flush=True)
            found = [step]
        except AsyncRLError as error:
            found = [str(error)]
    dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], str):
        raise AsyncRLError(found[0])
    return found[0]


def _rng_state(device: torch.device) -> dict:
    version, mt_state, gauss = random.getstate()
    name, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(mt_state), gauss],
        "numpy": [name, keys.tolist(), position, has_gauss, cached],
        "torch": torch.get_rng_state().tolist(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).tolist()
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), device)
