"""Exact resume, for real: a run stopped with Ctrl-C and continued with `asyncrl rl --resume` (or `asyncrl
sft --resume`) logs what the uninterrupted run logged, passing over a corrupted checkpoint."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rl_runs import ctrl_c_reaches_it  # tests/integration, on sys.path under pytest

from asyncrl.checkpoints import RL_PARTS, find_resume_step, part_dir
from asyncrl.metrics import read_jsonl
from asyncrl.models.offline import init_model
from asyncrl.transport.weights import MARKER, weights_dir

pytestmark = pytest.mark.integration

# max_async_level 0: batch n comes from policy n - 1 exactly, so the run repeats itself (up to fp32 rounding).
RL_ARGS = [
    "--max-steps", "8", "--seq-len", "96", "--seed", "3", "--inference.port", "0",
    "--ckpt.interval", "2", "--ckpt.keep-last", "3",
    "--orchestrator.batch-size", "8", "--orchestrator.group-size", "4", "--orchestrator.max-async-level", "0",
    "--orchestrator.sampling.max-tokens", "8", "--orchestrator.max-inflight", "1", "--trainer.optim.lr", "1e-2",
    "--trainer.optim.scheduler", "cosine", "--trainer.optim.warmup-steps", "1",
    "--deployment.inference-threads", "1", "--deployment.trainer-threads", "1",
]  # fmt: skip
SFT_ARGS = [
    "--max-steps", "6", "--seq-len", "128", "--data.batch-size", "8", "--log-interval", "1",
    "--optim.lr", "3e-3", "--optim.scheduler", "linear", "--optim.warmup-steps", "2",
    "--eval.size", "16", "--eval.interval", "2", "--ckpt.interval", "2", "--num-threads", "1",
]  # fmt: skip
# Values that depend on timing, not on the computation.
TIMING = ("time", "perf/", "time/", "timestamp/", "event_loop_lag_ms/")


def asyncrl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "asyncrl", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def logged(output_dir: Path) -> dict[tuple[int, str], dict[str, float]]:
    """The numbers logged per (step, source), less those that measure time."""
    return {
        (r["step"], r["source"]): {
            k: v for k, v in r.items() if isinstance(v, int | float) and k != "step" and not k.startswith(TIMING)
        }
        for r in read_jsonl(output_dir / "metrics.jsonl")
    }


def assert_same_metrics(resumed: dict, reference: dict) -> None:
    """Bit for bit. The engine seeds every sample, so the same tokens are drawn; and with one group in flight
    at a time (`max_inflight = 1`) every inference batch has the same make-up, so the logprobs it records,
    which enter the loss, are the same to the last bit (docs/checkpoints.md)."""
    assert resumed.keys() == reference.keys()
    for key, expected in reference.items():
        assert resumed[key] == expected, key


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny"
    init_model(path, "tiny")
    return path


def stop_after_trainer_step(args: list[str], output_dir: Path, step: int, timeout: float = 300) -> int:
    """Start `asyncrl rl`, press Ctrl-C (SIGINT) once the trainer has logged `step`; the exit code."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "asyncrl", "rl", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        preexec_fn=ctrl_c_reaches_it,
    )
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        lines = (output_dir / "metrics.jsonl").read_text() if (output_dir / "metrics.jsonl").exists() else ""
        if f'"step": {step}, "source": "trainer"' in lines:
            process.send_signal(signal.SIGINT)
            break
        time.sleep(0.1)
    return process.wait(timeout=60)


def test_rl_run_stopped_and_resumed_repeats_the_uninterrupted_run(tiny_model, tmp_path):
    reference_run, run = tmp_path / "reference", tmp_path / "run"
    result = asyncrl("rl", "--model.name", str(tiny_model), "--output-dir", str(reference_run), *RL_ARGS)
    assert result.returncode == 0, result.stdout + result.stderr
    reference = logged(reference_run)

    args = ["--model.name", str(tiny_model), "--output-dir", str(run), *RL_ARGS]
    assert stop_after_trainer_step(args, run, step=5) == 130
    # Checkpoint 4, or 6 if the trainer finished step 6 before the signal landed.
    newest, _ = find_resume_step(run, RL_PARTS, None)
    assert newest in (4, 6)
    shard = next((part_dir(run, newest, "trainer") / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # then a disk fault cuts the newest checkpoint short

    result = asyncrl("rl", *args, "--resume")
    assert result.returncode == 0, result.stdout + result.stderr
    start = newest - 2
    assert f"checkpoint step {newest} refused" in result.stdout and f"from checkpoint step {start}" in result.stdout
    resumed = logged(run)
    assert_same_metrics(resumed, reference)
    # The off-policy bound held across the resume: the first resumed batch came from the checkpoint's policy
    # (published again by the trainer where weight pruning had deleted it), each later one from the last.
    assert [resumed[(n, "orchestrator")]["policy_version"] for n in range(start + 1, 9)] == list(range(start, 8))
    assert all(resumed[(n, "orchestrator")]["off_policy/max"] == 0 for n in range(start + 1, 9))
    assert (weights_dir(run, 8) / MARKER).exists()


def test_sft_resume_repeats_losses_and_eval_losses(tiny_model, tmp_path):
    run = tmp_path / "sft"
    result = asyncrl("sft", "--model.name", str(tiny_model), "--output-dir", str(run), *SFT_ARGS)
    assert result.returncode == 0, result.stdout + result.stderr
    reference = logged(run)
    assert [step for step, _ in reference if "eval/loss" in reference[(step, "sft")]] == [2, 4, 6]
    final = (run / "final" / "model.safetensors").read_bytes()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_4", "step_6"]  # keep_last 2

    again = asyncrl("sft", "--model.name", str(tiny_model), "--output-dir", str(run), *SFT_ARGS)
    assert again.returncode == 2 and "--resume" in again.stderr  # never mixes two runs' checkpoints

    shutil.rmtree(run / "final")
    result = asyncrl("sft", "--model.name", str(tiny_model), "--output-dir", str(run), *SFT_ARGS, "--resume.step", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert_same_metrics(logged(run), reference)
    assert (run / "final" / "model.safetensors").read_bytes() == final
