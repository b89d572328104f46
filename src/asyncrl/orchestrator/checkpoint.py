"""The orchestrator's part of a checkpoint, and what makes a resumed run neither lose nor repeat an example.

    checkpoints/step_N/orchestrator/progress.json    the step, the example sampler's state, the group counter,
                                                     the groups drawn but unfinished, the queue
    checkpoints/step_N/orchestrator/MANIFEST.json    written last (asyncrl.checkpoints)

Saved once batch N is written, at the same steps as the trainer's part. A resumed run restores the example
sampler (orchestrator/sampler.py), so it draws the very examples the interrupted run would have drawn next;
sends again, first, the groups that were in flight (their examples are saved, not their partial
rollouts); and starts with the queue as it was: finished groups waiting for a batch, with their tokens,
logprobs, versions, rewards and advantages (`Rollout.state`, the environment's scratch space, is not kept).
Every group samples with a seed derived from (run seed, group number), so the engine draws the same
tokens for it whatever else shares its batch.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncrl import checkpoints
from asyncrl.environments.base import Example, Rollout, TokenSample
from asyncrl.errors import AsyncRLError
from asyncrl.orchestrator.queue import ScoredGroup
from asyncrl.orchestrator.sampler import EnvironmentSampler
from asyncrl.transport import routing

PART = "orchestrator"


@dataclass
class PendingGroup:
    """A group drawn and sent out, but not finished when the checkpoint was taken."""

    index: int
    label: str
    example: dict[str, Any]  # Example's fields


@dataclass
class OrchestratorProgress:
    step: int  # batches 1..step are written
    policy_version: int  # the oldest policy version the servers held when batch `step` was cut
    sampler: dict  # EnvironmentSampler.state_dict(): examples drawn per environment
    next_group: int = 0  # groups drawn so far
    pending: list[PendingGroup] = field(default_factory=list)
    queue: list[dict[str, Any]] = field(default_factory=list)  # encode_group() of each queued group, in order


def group_seed(seed: int, index: int) -> int:
    """The sampling seed of the `index`-th group (0-based) drawn by a run seeded `seed`."""
    return random.Random(f"{seed}/{index}").getrandbits(48)


def encode_example(example: Example) -> dict[str, Any]:
    return {"prompt": example.prompt, "answer": example.answer, "info": example.info}


def pending_group(index: int, label: str, example: Example) -> PendingGroup:
    return PendingGroup(index, label, encode_example(example))


def decode_example(data: dict[str, Any]) -> Example:
    return Example(data["prompt"], data["answer"], data.get("info", {}))


def encode_group(group: ScoredGroup) -> dict[str, Any]:
    rollouts = []
    for r in group.rollouts:
        fields = asdict(r)
        fields.pop("state")
        fields.pop("example")
        for sample in fields["samples"]:
            if sample["routed_experts"] is not None:
                sample["routed_experts"] = routing.encode(sample["routed_experts"])
        rollouts.append(fields)
    return {
        "index": group.index,
        "label": group.label,
        "example": encode_example(group.example),
        "rollouts": rollouts,
        "advantages": group.advantages,
        "dispatched_at": group.dispatched_at,
        "finished_at": group.finished_at,
        "server": group.server,
    }


def decode_group(data: dict[str, Any]) -> ScoredGroup:
    example = decode_example(data["example"])
    rollouts = []
    for fields in data["rollouts"]:
        samples = [TokenSample(**s) for s in fields.pop("samples")]
        for sample in samples:
            if sample.routed_experts is not None:
                sample.routed_experts = routing.decode(sample.routed_experts)
        rollouts.append(Rollout(example=example, samples=samples, **fields))
    return ScoredGroup(
        data["index"],
        data["label"],
        example,
        rollouts,
        data["advantages"],
        data["dispatched_at"],
        data["finished_at"],
        data["server"],
    )


def save(output_dir: Path, progress: OrchestratorProgress, queue: list[ScoredGroup]) -> None:
    """Write `progress` with `queue` (the queued groups, in order) encoded into it. The orchestrator runs this in
    a thread: encoding a queue of rollouts and writing it takes long enough to hold up its event loop, and
    queued groups are never changed, only taken, so the list it snapshots on the loop is safe to read here."""
    progress.queue = [encode_group(g) for g in queue]
    staging = checkpoints.begin_part(output_dir, progress.step, PART)
    # Environments may keep anything in an example's info: what JSON cannot hold is saved as its text.
    (staging / "progress.json").write_text(json.dumps(asdict(progress), default=repr))
    checkpoints.finish_part(output_dir, progress.step, PART)


def resume(output_dir: Path, requested: int | None, sampler: EnvironmentSampler) -> OrchestratorProgress:
    """Restore `sampler` from checkpoint `requested` (None: the newest one whose trainer and orchestrator
    parts are both whole) and return its progress. Raises AsyncRLError naming the problem."""
    step, refused = checkpoints.find_resume_step(output_dir, checkpoints.RL_PARTS, requested)
    for line in refused:
        print(f"orchestrator: {line}; trying an older one", flush=True)
    path = checkpoints.part_dir(output_dir, step, PART) / "progress.json"
    saved = json.loads(path.read_text())
    saved["pending"] = [PendingGroup(**p) for p in saved.get("pending", [])]
    progress = OrchestratorProgress(**saved)
    try:
        sampler.load_state_dict(progress.sampler)
    except ValueError as error:
        raise AsyncRLError(
            f"checkpoint {path.parent} does not fit this run: {error} (resume with the run's own orchestrator config)"
        ) from None
    unknown = {p.label for p in progress.pending} - set(sampler.environments)
    if unknown:
        raise AsyncRLError(f"checkpoint {path.parent} has groups of environments {sorted(unknown)} not in this config")
    print(f"orchestrator: resumed from checkpoint {path.parent}", flush=True)
    return progress
