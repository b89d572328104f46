"""The run folder of `asyncrl rl` on this machine: a new run's (a folder that holds a run is refused without
--clean), a resumed run's (rewound to its checkpoint), and whether a folder holds a run at all (a dry run
writes nothing into one).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from asyncrl import checkpoints
from asyncrl.errors import AsyncRLError
from asyncrl.live_view import console

RUN_ARTIFACTS = (
    "configs", "logs", "rollouts", "weights", "checkpoints", "metrics.jsonl", "samples.jsonl", "wandb", "tensorboard",
)  # fmt: skip


def held_run(output_dir: Path) -> list[str]:
    """What of a run the folder holds (configs alone are none: a dry run writes them)."""
    return [name for name in RUN_ARTIFACTS if name != "configs" and (output_dir / name).exists()]


def prepare_output_dir(output_dir: Path, clean: bool) -> None:
    existing = [name for name in RUN_ARTIFACTS if (output_dir / name).exists()]
    # Configs alone are no run (a dry run wrote them, or a launch stopped before starting anything): replaced.
    if existing and existing != ["configs"] and not clean:
        raise AsyncRLError(
            f"output_dir '{output_dir}' already holds a run ({', '.join(existing)}); pass --clean to delete it, "
            "--resume to continue it from its last checkpoint, or set output_dir to a new folder"
        )
    for name in existing:
        path = output_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (output_dir / "logs").mkdir(parents=True, exist_ok=True)


def resume_run(output_dir: Path, requested: int | None, max_steps: int, clean: bool) -> int:
    """The checkpoint `asyncrl rl --resume` continues from (`requested`, or the newest whole one); the run
    folder is rewound to it, so later weights, batches and metric lines are made again."""
    if clean:
        raise AsyncRLError("--resume continues the run in output_dir and --clean deletes it; give one of them")
    step, refused = checkpoints.find_resume_step(output_dir, checkpoints.RL_PARTS, requested)
    for line in refused:
        console.print(f"{line}; trying an older one", markup=False, soft_wrap=True)
    if step >= max_steps:
        raise AsyncRLError(f"checkpoint step {step} is already at max_steps ({max_steps}); raise max_steps to go on")
    checkpoints.rewind(output_dir, step)
    (output_dir / "logs").mkdir(parents=True, exist_ok=True)
    console.print(f"resuming {output_dir} from checkpoint step {step}", markup=False, soft_wrap=True)
    return step
