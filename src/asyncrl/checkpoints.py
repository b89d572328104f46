"""A run's checkpoints on disk: `checkpoints/step_N/{trainer,orchestrator}`, each part complete or refused.

A process writes its part into a staging folder (`.trainer.tmp`), then lists every file with its size and
SHA-256 in `MANIFEST.json` and renames the folder into place. So a part folder without a manifest was cut
off while being written, and a file whose size or checksum differs from the manifest was corrupted later;
both are refused with the reason, and resuming falls back to the newest checkpoint that is whole.

Checkpoint N of an RL run is usable once both parts of step N are (the trainer after step N, the
orchestrator after writing batch N); an SFT run has the trainer part only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from asyncrl.errors import AsyncRLError

MANIFEST = "MANIFEST.json"
RL_PARTS = ("trainer", "orchestrator")
SFT_PARTS = ("trainer",)


def step_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step}"


def part_dir(output_dir: Path, step: int, part: str) -> Path:
    return step_dir(output_dir, step) / part


def staging_dir(output_dir: Path, step: int, part: str) -> Path:
    return step_dir(output_dir, step) / f".{part}.tmp"


def begin_part(output_dir: Path, step: int, part: str) -> Path:
    """An empty staging folder for `part` of checkpoint `step`; write into it, then call `finish_part`."""
    staging = staging_dir(output_dir, step, part)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def finish_part(output_dir: Path, step: int, part: str) -> Path:
    """Checksum the staged files into the manifest, then rename the folder into place (atomic)."""
    staging = staging_dir(output_dir, step, part)
    files = {
        str(path.relative_to(staging)): {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(staging.rglob("*"))
        if path.is_file()
    }
    with open(staging / MANIFEST, "w") as f:
        json.dump({"step": step, "part": part, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    final = part_dir(output_dir, step, part)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    return final


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def part_problem(path: Path) -> str | None:
    """Why the part folder `path` cannot be used, or None when every file matches its manifest."""
    if not path.is_dir():
        stopped = path.with_name(f".{path.name}.tmp").exists()
        return f"{path} is missing" + (" (its writer stopped before finishing it)" if stopped else "")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path} has no readable {MANIFEST} (it was not written to the end)"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{file} has {file.stat().st_size} bytes, the manifest says {expected['bytes']} (corrupted)"
        if _sha256(file) != expected["sha256"]:
            return f"{file} does not match its SHA-256 in the manifest (corrupted)"
    return None


def checkpoint_problem(output_dir: Path, step: int, parts: tuple[str, ...]) -> str | None:
    for part in parts:
        problem = part_problem(part_dir(output_dir, step, part))
        if problem:
            return problem
    return None


def saved_steps(output_dir: Path) -> list[int]:
    """Steps with a checkpoint folder, whole or not, oldest first."""
    root = Path(output_dir) / "checkpoints"
    names = [p.name.removeprefix("step_") for p in root.glob("step_*")] if root.is_dir() else []
    return sorted(int(n) for n in names if n.isdigit())


def find_resume_step(output_dir: Path, parts: tuple[str, ...], requested: int | None) -> tuple[int, list[str]]:
    """The checkpoint to resume from: `requested`, or the newest whole one. Also returns why newer ones were
    passed over. Raises AsyncRLError when the requested checkpoint is not whole, or none is."""
    if requested is not None:
        problem = checkpoint_problem(output_dir, requested, parts)
        if problem:
            raise AsyncRLError(
                f"cannot resume from checkpoint step {requested}: {problem} "
                f"(resume from another step, or use --resume alone for the newest complete checkpoint)"
            )
        return requested, []
    refused = []
    for step in reversed(saved_steps(output_dir)):
        problem = checkpoint_problem(output_dir, step, parts)
        if problem is None:
            return step, refused
        refused.append(f"checkpoint step {step} refused: {problem}")
    found = f"; refused: {'; '.join(refused)}" if refused else ""
    raise AsyncRLError(
        f"no complete checkpoint to resume from in {Path(output_dir) / 'checkpoints'}{found} "
        "(checkpoints are saved every ckpt.interval steps; start without --resume)"
    )


def prune(output_dir: Path, parts: tuple[str, ...], keep_last: int) -> None:
    """Keep the newest `keep_last` finished checkpoints (manifests present; not re-hashed) and everything
    newer, which may still be being written; delete the older ones."""
    finished = [
        step
        for step in saved_steps(output_dir)
        if all((part_dir(output_dir, step, part) / MANIFEST).exists() for part in parts)
    ]
    if len(finished) <= keep_last:
        return
    oldest_kept = finished[-keep_last]
    for step in saved_steps(output_dir):
        if step < oldest_kept:
            shutil.rmtree(step_dir(output_dir, step), ignore_errors=True)


def rewind(output_dir: Path, step: int) -> None:
    """Make the run folder look as it did just after step `step`: later weights, rollouts, checkpoints and
    metric/sample lines belong to the interrupted run and are deleted, so the resumed run rewrites them."""
    output_dir = Path(output_dir)
    for folder in ("weights", "rollouts", "checkpoints"):
        root = output_dir / folder
        for path in root.glob("*step_*") if root.is_dir() else []:
            number = path.name.removeprefix(".").removeprefix("step_").removesuffix(".tmp")
            if number.isdigit() and int(number) > step:
                shutil.rmtree(path, ignore_errors=True)
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = output_dir / name
        if path.exists():
            kept = [record for record in _whole_lines(path) if record.get("step", 0) <= step]
            tmp = path.with_name(f".{name}.tmp")
            tmp.write_text("".join(json.dumps(record) + "\n" for record in kept))
            os.replace(tmp, path)


def _whole_lines(path: Path) -> list[dict]:
    """The records of a JSONL file, less a last line cut off mid-write (its writer was killed, or the disk
    was full)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
