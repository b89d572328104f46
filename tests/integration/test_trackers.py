"""Experiment trackers on real runs: an offline W&B run and TensorBoard event files hold every metric of the
run's metrics.jsonl, from every process; a tracker that cannot start is reported once and the run goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.metrics import read_jsonl
from asyncrl.models.offline import init_model

pytestmark = pytest.mark.integration


def logged(run: Path) -> dict[tuple[str, int], float]:
    """Every metric value of metrics.jsonl, as trackers name it: (`source/name`, step) -> value."""
    values = {}
    for record in read_jsonl(run / "metrics.jsonl"):
        for name, value in record.items():
            if name not in ("step", "source", "time"):
                values[(f"{record['source']}/{name}", record["step"])] = value
    return values


def test_a_wandb_offline_run_holds_every_metric_of_metrics_jsonl(runs):
    wandb_offline = pytest.importorskip("wandb_offline", reason="needs wandb (pip install 'asyncrl[track]')")
    (run_dir,) = (runs / "first" / "wandb").glob("offline-run-*")
    tracked = {}
    for row in wandb_offline.history(run_dir):
        for key, value in row.items():
            if key != "step" and not key.startswith(("_", "samples/")):
                tracked[(key, row["step"])] = value
    expected = logged(runs / "first")
    names = {name for name, _ in expected}
    assert {"orchestrator/reward/mean", "trainer/loss", "orchestrator/eval/reverse_text/avg@4"} <= names
    assert tracked == pytest.approx(expected)

    config = wandb_offline.config(run_dir)
    assert config["max_steps"] == 3 and config["orchestrator"]["batch_size"] == 8
    (url,) = config["orchestrator"]["inference_urls"]  # as resolved by the launcher: the server's real port
    assert url.startswith("http://127.0.0.1:") and url != "http://127.0.0.1:8000"

    tables = sorted((run_dir / "files" / "media" / "table").glob("samples_*.table.json"))
    rows = [row for table in tables for row in json.loads(table.read_text())["data"]]
    columns = json.loads(tables[0].read_text())["columns"]
    assert columns[:3] == ["step", "env", "prompt"]
    assert len(rows) == len(read_jsonl(runs / "first" / "samples.jsonl")) - 2  # the two lines added after the run


def test_tensorboard_event_files_hold_every_metric(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs / "first" / "tensorboard"))
    events.Reload()
    tracked = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert tracked == pytest.approx(logged(runs / "first"), rel=1e-6)  # stored as float32


def test_trackers_that_cannot_start_are_reported_once_and_the_run_goes_on(tmp_path):
    pytest.importorskip("wandb", reason="needs wandb (pip install 'asyncrl[track]'): its own error is expected")
    init_model(tmp_path / "tiny", "tiny", seed=0)
    (tmp_path / "a_file").touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {"HOME": str(tmp_path)}
    result = subprocess.run(
        [
            sys.executable, "-m", "asyncrl", "sft", "--model.name", str(tmp_path / "tiny"), "--max-steps", "2",
            "--data.batch-size", "4", "--seq-len", "128", "--log-interval", "1", "--num-threads", "1",
            "--output-dir", str(tmp_path / "sft"), "--wandb.mode", "online",  # no W&B API key here
            "--tensorboard.enabled", "--tensorboard.dir", str(tmp_path / "a_file" / "tb"),
        ],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    failures = [line for line in result.stderr.splitlines() if "tracking failed" in line]
    assert len(failures) == 2
    assert failures[0].startswith("asyncrl: wandb tracking failed: UsageError: No API key configured")
    assert failures[1].startswith("asyncrl: tensorboard tracking failed: NotADirectoryError")
    assert all(line.endswith("; the run goes on without it") for line in failures)
    assert [r["step"] for r in read_jsonl(tmp_path / "sft" / "metrics.jsonl")] == [1, 2]
