"""The orchestrator's part of a checkpoint, and what makes a resumed run generate what an uninterrupted one would.

    checkpoints/step_N/orchestrator/progress.json    the step, the policy version, the example sampler's state
    checkpoints/step_N/orchestrator/MANIFEST.json    written last (asyncrl.checkpoints)

Saved once batch N is written, at the same steps as the trainer's part. A resumed run restores the
example sampler (orchestrator/sampler.py), so it draws the very examples the interrupted run would have drawn
next; and every generate request carries a seed derived from (run seed, step, group), so the engine samples
the same tokens (it seeds one generator per sample, whatever else shares its batch).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncrl import checkpoints
from asyncrl.errors import AsyncRLError
from asyncrl.orchestrator.sampler import EnvironmentSampler

PART = "orchestrator"


@dataclass
class OrchestratorProgress:
    step: int  # batches 1..step are written
    policy_version: int  # the policy version inference served for batch `step`
    sampler: dict  # EnvironmentSampler.state_dict(): examples drawn per environment


def group_seed(seed: int, step: int, group: int) -> int:
    """The sampling seed of group `group` (0-based, in batch order) of batch `step` of a run seeded `seed`."""
    return random.Random(f"{seed}/{step}/{group}").getrandbits(48)


def save(output_dir: Path, progress: OrchestratorProgress) -> None:
    staging = checkpoints.begin_part(output_dir, progress.step, PART)
    (staging / "progress.json").write_text(json.dumps(asdict(progress)))
    checkpoints.finish_part(output_dir, progress.step, PART)


def resume(output_dir: Path, requested: int | None, sampler: EnvironmentSampler) -> OrchestratorProgress:
    """Restore `sampler` from checkpoint `requested` (None: the newest one whose trainer and orchestrator
    parts are both whole) and return its progress. Raises AsyncRLError naming the problem."""
    step, refused = checkpoints.find_resume_step(output_dir, checkpoints.RL_PARTS, requested)
    for line in refused:
        print(f"orchestrator: {line}; trying an older one", flush=True)
    path = checkpoints.part_dir(output_dir, step, PART) / "progress.json"
    progress = OrchestratorProgress(**json.loads(path.read_text()))
    try:
        sampler.load_state_dict(progress.sampler)
    except ValueError as error:
        raise AsyncRLError(
            f"checkpoint {path.parent} does not fit this run: {error} (resume with the run's own orchestrator config)"
        ) from None
    print(f"orchestrator: resumed from checkpoint {path.parent}", flush=True)
    return progress
