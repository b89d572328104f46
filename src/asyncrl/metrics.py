"""`metrics.jsonl` and `samples.jsonl`: one JSON object per line, appended by every process of a run.

Each line is written with a single `write` on a file opened in append mode, so lines from the
orchestrator and the trainer never interleave.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.trackers import Trackers


class JsonlWriter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, default=float) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        except OSError as error:  # os.write names no file
            raise OSError(error.errno, error.strerror, str(self.path)) from None
        finally:
            os.close(fd)


class MetricsLogger(JsonlWriter):
    """Writes `{"step", "source", "time", ...metrics}` lines to `<output_dir>/metrics.jsonl`, and to the
    experiment trackers where this process holds them (docs/metrics.md lists the names)."""

    def __init__(self, output_dir: Path, source: str, trackers: Trackers | None = None):
        super().__init__(Path(output_dir) / "metrics.jsonl")
        self.source = source
        self.trackers = trackers

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "source": self.source, "time": time.time(), **metrics}
        self.write(record)
        if self.trackers is not None:
            self.trackers.log(record)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file, also while a run appends to it: a last line without its newline is a record
    still being written (a reader saw half of one on a loaded machine) and is left for the next read."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]
