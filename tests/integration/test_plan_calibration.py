"""asyncrl plan --calibrate on real runs: the model, calibrated on a short run, gives back its s/step."""

from __future__ import annotations

import subprocess
import sys

import pytest
from rl_runs import run_rl

from asyncrl.models.offline import init_model
from asyncrl.plan.calibrate import calibrate, layout, measured_step_s
from asyncrl.plan.model import predict

pytestmark = pytest.mark.integration


# Short runs on two shared cores: at max_async_level 0 the step is a sum and the model lands within a few
# percent; at levels 1 and 2 nine steps of 50-100 ms vary by about ten points from run to run (the
# benchmark's longer runs are the 20% check, docs/clusters.md), so those cases are held to 30%.
@pytest.mark.parametrize(
    ("level", "replicas", "mode", "max_tokens", "tolerance"),
    [
        (0, 1, "filesystem", 8, 0.2),
        (0, 2, "filesystem", 8, 0.2),
        (0, 1, "colocated", 8, 0.2),
        (1, 1, "filesystem", 32, 0.3),
        (2, 1, "filesystem", 32, 0.3),
    ],
)
def test_calibrated_model_reproduces_the_runs_step_time(tmp_path, level, replicas, mode, max_tokens, tolerance):
    init_model(tmp_path / "tiny", "tiny", seed=0)
    flags = ("--orchestrator.max-async-level", str(level), "--deployment.inference-replicas", str(replicas),
             "--weight-transfer.mode", mode, "--orchestrator.sampling.max-tokens", str(max_tokens))  # fmt: skip
    result = run_rl(tmp_path / "tiny", tmp_path / "run", "--max-steps", "12", *flags)
    assert result.returncode == 0, result.stdout + result.stderr
    parts = calibrate(tmp_path / "run")
    assert parts.max_async_level == level and parts.batch_size == 8 and set(parts.publish) == {mode}
    assert layout(tmp_path / "run") == (replicas, 1)
    predicted = predict(parts, *layout(tmp_path / "run"), mode).step_s
    measured = measured_step_s(tmp_path / "run")
    assert abs(predicted - measured) <= tolerance * measured, (
        f"predicted {predicted:.3f} s/step, measured {measured:.3f}"
    )

    shown = subprocess.run(
        [sys.executable, "-m", "asyncrl", "plan", "--calibrate", str(tmp_path / "run"), "--gpus", "4"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert f"predicted {predicted:.3f} s/step" in shown.stdout and "PREDICTION for 4 GPUs" in shown.stdout
