"""Expert parallelism on two CPU ranks (gloo): with trainer.ep = 2 each rank holds half of every layer's experts
and the tokens travel by all-to-all, yet two RL steps give the same losses, routing metrics, gradients and
weights as ep = 1 (FSDP2 alone) on the same two ranks and the same rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.models.offline import init_model

WORKER = Path(__file__).with_name("expert_parallel_worker.py")


def run_ranks(model: Path, ep: int, output: Path, checkpointing: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    result = subprocess.run(
        [*command, str(model), str(ep), str(output), checkpointing],
        capture_output=True,
        text=True,
        timeout=240,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((output / f"ep{ep}.json").read_text()), load_file(output / f"ep{ep}.safetensors")


@pytest.mark.integration
@pytest.mark.parametrize("architecture", ["qwen3_moe", "glm4_moe"])
def test_two_expert_parallel_ranks_train_as_one_copy_of_the_experts(tmp_path, architecture):
    model = tmp_path / "model"
    init_model(model, "tiny", architecture=architecture)
    # selective recompute: the recomputed layer exchanges its tokens again in the backward
    checkpointing = "selective" if architecture == "glm4_moe" else "off"
    steps_1, tensors_1 = run_ranks(model, 1, tmp_path, checkpointing)
    steps_2, tensors_2 = run_ranks(model, 2, tmp_path, checkpointing)
    for one, two in zip(steps_1, steps_2):
        assert one.keys() == two.keys() and "moe/aux_loss" in one
        for key in one:
            assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    assert tensors_1.keys() == tensors_2.keys()
    assert any(".mlp.experts.gate_up_proj" in name for name in tensors_1)
    for name, tensor in tensors_1.items():
        # AdamW's first steps move every weight by about lr (1e-2) whatever its gradient's size, so a gradient
        # within rounding of 0 may move it a little differently: weights get a looser bound than gradients.
        atol = 5e-5 if name.startswith("weight.") else 1e-6
        torch.testing.assert_close(tensors_2[name], tensor, rtol=1e-5, atol=atol, msg=name)
