"""`asyncrl rl` refuses what it can see is wrong before it starts anything, and stops a run that can learn
nothing, each with one line: prompts longer than seq_len, a folder another run holds, batches without a
sampled token."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl.models.offline import init_model
from asyncrl.run_lock import LOCK_NAME

pytestmark = pytest.mark.integration

ARGS = [
    "--seq-len", "96", "--orchestrator.batch-size", "8", "--orchestrator.group-size", "4",
    "--orchestrator.sampling.max-tokens", "8", "--deployment.inference-threads", "1",
    "--deployment.trainer-threads", "1", "--deployment.inference-device", "cpu", "--deployment.trainer-device", "cpu",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny"
    init_model(path, "tiny")
    return path


def rl(model: Path, run: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "asyncrl", "rl", "--model.name", str(model), "--output-dir", str(run), *ARGS, *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def test_prompts_longer_than_seq_len_are_refused_before_anything_starts(tiny_model, tmp_path):
    result = rl(tiny_model, tmp_path / "run", "--max-steps", "2", "--seq-len", "16")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "asyncrl rl: error: the first 64 prompts of environment 'reverse_text' are 23-31 tokens: none leaves room "
        "for an answer within seq_len = 16, so the run would train nothing (raise seq_len to at least 39)"
    )
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []  # no process started, nothing written


def test_a_folder_held_by_a_live_run_is_refused_naming_it(tiny_model, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "source": "trainer"}\n')
    holder_script = textwrap.dedent(
        f"""
        import time
        from asyncrl.run_lock import RunLock
        lock = RunLock.acquire({str(run)!r}, "asyncrl rl")
        print("locked", flush=True)
        time.sleep(300)
        """
    )
    holder = subprocess.Popen([sys.executable, "-c", holder_script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = rl(tiny_model, run, "--max-steps", "2", "--resume")
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"asyncrl rl: error: output_dir '{run}' is in use by asyncrl rl (pid {holder.pid} on host")
    assert line.endswith(f"(lock: {run / LOCK_NAME}); stop that run first, or set output_dir to another folder")
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "source": "trainer"}\n'  # not rewound


def test_batches_without_a_sampled_token_stop_the_run(tiny_model, tmp_path):
    """An environment whose time limit ends every episode before its first answer: nothing to learn from."""
    result = rl(tiny_model, tmp_path / "run", "--max-steps", "20",
                "--orchestrator.environments.reverse_text.args", "{time_limit = 1e-9}")  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "orchestrator exited with code 2 (asyncrl orchestrator: error: batches 1-3 hold no sampled token" in (
        " ".join(result.stdout.split())
    )
