"""What the dashboard reads from run folders (README: "A run on disk"), while the run may still be writing.

Files are read from a byte offset the page keeps, whole lines only, so a page that polls gets each metric
line once and a line being written is read on the next poll. A file that got shorter than the offset was
rewound (`asyncrl rl --resume`) and is read again from the start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.errors import AsyncRLError

RUN_MARKERS = ("metrics.jsonl", "configs", "samples.jsonl")
LOG_TAIL_BYTES = 64 * 1024


def is_run(path: Path) -> bool:
    return any((path / marker).exists() for marker in RUN_MARKERS)


def find_runs(paths: list[Path]) -> dict[str, Path]:
    """Runs by a short unique name: each path that is a run, and each run folder directly inside the others
    (`asyncrl dashboard outputs` shows every run under outputs/, including ones started later)."""
    found: list[Path] = []
    for path in paths:
        if is_run(path):
            found.append(path)
        elif path.is_dir():
            found += sorted(child for child in path.iterdir() if child.is_dir() and is_run(child))
    runs: dict[str, Path] = {}
    for run in found:
        name = run.name
        if name in runs and runs[name] != run:
            name = f"{run.parent.name}/{run.name}"
        runs[name] = run
    return runs


def check_paths(paths: list[Path]) -> None:
    for path in paths:
        if not path.is_dir():
            raise AsyncRLError(f"run folder '{path}' not found (give an asyncrl output_dir, or a folder holding runs)")


@dataclass
class Chunk:
    records: list[dict[str, Any]]
    offset: int  # where the next read starts
    reset: bool  # the file was rewound: forget what was read before


def read_lines(path: Path, offset: int) -> Chunk:
    """The JSON lines appended to `path` since `offset` (whole lines only)."""
    if not path.exists():
        return Chunk([], 0, offset > 0)
    size = path.stat().st_size
    reset = size < offset
    start = 0 if reset else offset
    with open(path, "rb") as f:
        f.seek(start)
        chunk = f.read(size - start)
    complete = chunk[: chunk.rfind(b"\n") + 1]
    records = []
    for line in complete.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a torn line from a crashed writer: skip it, keep the rest
            continue
    return Chunk(records, start + len(complete), reset)


def configs(run: Path) -> dict[str, str]:
    """The resolved config of each process, as written by `asyncrl rl` (configs/*.toml)."""
    return {p.stem: p.read_text(errors="replace") for p in sorted((run / "configs").glob("*.toml"))}


def log_files(run: Path) -> list[str]:
    """Log paths relative to logs/: inference.log, orchestrator.log, trainer.log, trainer/rank_R.log."""
    logs = run / "logs"
    return sorted(str(p.relative_to(logs)) for p in logs.rglob("*.log")) if logs.is_dir() else []


def log_tail(run: Path, name: str, max_lines: int = 200) -> str:
    if name not in log_files(run):  # only files listed above: no path from the page reaches the disk
        raise KeyError(name)
    path = run / "logs" / name
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - LOG_TAIL_BYTES))
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-max_lines:])


class SampleIndex:
    """Byte offsets of samples.jsonl lines by step, extended as the file grows, so the viewer reads one
    step's rollouts without parsing the whole file."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.by_step: dict[int, list[int]] = {}

    def refresh(self) -> None:
        if not self.path.exists():
            self.offset, self.by_step = 0, {}
            return
        if self.path.stat().st_size < self.offset:
            self.offset, self.by_step = 0, {}
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            position = self.offset
            for line in f:
                if not line.endswith(b"\n"):
                    break
                try:
                    step = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    step = None
                if step is not None:
                    self.by_step.setdefault(step, []).append(position)
                position += len(line)
            self.offset = position

    def steps(self) -> list[int]:
        self.refresh()
        return sorted(self.by_step)

    def records(self, step: int) -> list[dict[str, Any]]:
        self.refresh()
        out = []
        with open(self.path, "rb") as f:
            for position in self.by_step.get(step, []):
                f.seek(position)
                out.append(json.loads(f.readline()))
        return out
