"""`asyncrl rl`'s supervision of its processes, with real child processes standing in for them: an inference
replica that exits while another lives is reported and the run goes on; when the last one exits, the run
stops, saying that no inference server is left."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncrl.live_view import Progress
from asyncrl.supervision import Child, ChildFailed, supervise


def child(name: str, code: str, tmp_path) -> Child:
    process = subprocess.Popen([sys.executable, "-c", code])
    return Child(name, process, tmp_path / f"{name}.log")


def test_the_last_replica_to_exit_stops_the_run_saying_no_server_is_left(tmp_path):
    trainer = child("trainer", "import time; time.sleep(30)", tmp_path)
    first = child("inference_0", "raise SystemExit(1)", tmp_path)
    last = child("inference_1", "import time; time.sleep(1.5); raise SystemExit(1)", tmp_path)
    try:
        with pytest.raises(ChildFailed) as failed:
            supervise([first, last, trainer], Progress(tmp_path / "metrics.jsonl", max_steps=1))
    finally:
        for c in (trainer, first, last):
            c.process.kill()
            c.process.wait(10)
    assert failed.value.child is last
    assert failed.value.note == "no inference server is left (inference_0 exited before)"


def test_a_trainer_that_fails_is_reported_without_a_note(tmp_path):
    trainer = child("trainer", "raise SystemExit(3)", tmp_path)
    replica = child("inference", "import time; time.sleep(30)", tmp_path)
    try:
        with pytest.raises(ChildFailed) as failed:
            supervise([replica, trainer], Progress(tmp_path / "metrics.jsonl", max_steps=1))
    finally:
        for c in (trainer, replica):
            c.process.kill()
            c.process.wait(10)
    assert failed.value.child is trainer and failed.value.note == ""
