"""`asyncrl sft` stops with one line, not a traceback, when it cannot go on: a disk that refuses a write
mid-run (the line names the file and the checkpoint to resume from), or steps that hold no token to train on
(seq_len shorter than the prompts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.models.offline import init_model

pytestmark = pytest.mark.integration

FULL = Path("/dev/full")  # refuses every write with ENOSPC, as a full disk does


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny"
    init_model(path, "tiny")
    return path


def sft(model: Path, output_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = ["sft", "--model.name", str(model), "--output-dir", str(output_dir), "--data.batch-size", "8",
            "--num-threads", "1", "--device", "cpu", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "asyncrl", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full")
def test_a_full_disk_mid_run_is_one_line_naming_the_file_and_the_checkpoint(tiny_model, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(FULL)  # the disk is full by the time step 3 is logged
    result = sft(tiny_model, run, "--max-steps", "4", "--seq-len", "128", "--ckpt.interval", "2", "--log-interval", "3")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"asyncrl sft: error: cannot write '{run / 'metrics.jsonl'}': No space left on device; the last complete "
        f"checkpoint is step 2 ({run / 'checkpoints' / 'step_2'}): free space or fix the folder's permissions, "
        "then continue with `asyncrl sft --resume`"
    )


def test_steps_without_a_token_to_train_on_stop_the_run(tiny_model, tmp_path):
    """reverse_text's prompts are 23-31 tokens: seq_len 16 leaves none of the answers."""
    result = sft(tiny_model, tmp_path / "run", "--max-steps", "20", "--seq-len", "16")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        "asyncrl sft: error: steps 1-3 had no answer token within seq_len = 16 (the prompts fill it"
    )
    assert "step 4" not in result.stdout
