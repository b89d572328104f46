"""Context parallelism on two CPU ranks (gloo): with trainer.cp = 2 the two ranks split every row's tokens and
exchange them for attention heads around attention, yet two RL steps give the same losses, metrics, gradients
and weights as trainer.cp = 1, for packed rows (three documents, a sequence-level loss), for rows of one long
document (of an odd length, so the last slice is padded; with recompute, which runs the exchange again), and for
a mixture-of-experts model with expert parallelism over the same ranks (ep = 2) and a balancing loss, whose
routing metrics must agree too (the padding routed by no summary).

What is compared: a step trains the same two rows in both runs. With cp = 1 the two ranks are two data-parallel
ranks and each reads a rollout file of one row; with cp = 2 they are one context-parallel group, which reads one
file of both rows (`rl.data_rank`). Either way the step's loss is the sum over the same two rows over the same
loss-token count, so every number must agree to rounding. The model is `offline.init_model`'s "small" (4 query
and 2 KV heads: cp = 2 splits both), dense and Qwen3-MoE; "tiny" has one KV head, which the error test uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from asyncrl.errors import AsyncRLError
from asyncrl.models.checkpoint import load_native
from asyncrl.models.offline import init_model
from asyncrl.trainer.model import check_context_parallel, device_meshes

WORKER = Path(__file__).with_name("context_parallel_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One torchrun of two ranks that trains every kind of row with cp = 1 and with cp = 2 (the worker)."""
    folder = tmp_path_factory.mktemp("context_parallel")
    init_model(folder / "model", "small")
    init_model(folder / "moe", "small", architecture="qwen3_moe")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    result = subprocess.run(
        [*command, str(folder / "model"), str(folder / "moe"), str(folder)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder


def results(folder: Path, case: str, cp: int) -> tuple[list[dict], dict[str, torch.Tensor]]:
    return json.loads((folder / f"{case}_cp{cp}.json").read_text()), load_file(folder / f"{case}_cp{cp}.safetensors")


@pytest.mark.integration
@pytest.mark.parametrize("case", ["packed", "one_document", "moe"])
def test_two_context_parallel_ranks_train_as_one_rank_per_row(runs, case):
    steps_1, tensors_1 = results(runs, case, 1)
    steps_2, tensors_2 = results(runs, case, 2)
    assert len(steps_1) == len(steps_2) == 2
    for one, two in zip(steps_1, steps_2):
        assert one.keys() == two.keys() and {"loss", "entropy", "mismatch_kl", "grad_norm"} <= one.keys()
        assert ("moe/aux_loss" in one) == (case == "moe")
        assert two["tokens"] == one["tokens"] == 2 * (60 if case == "packed" else 63)
        for key in one:
            assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    assert tensors_1.keys() == tensors_2.keys()
    assert any(name.startswith("step2.grad.") for name in tensors_1)
    for name, tensor in tensors_1.items():
        if name.startswith("step1."):  # on the same weights: equal to rounding
            torch.testing.assert_close(tensors_2[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
            continue
        if name.startswith("step2."):
            # On the weights after one step, which differ a little (below): measured up to 2e-4 of the tensor's
            # largest entry (the mixture-of-experts model on transformers 5.25's random init; 2e-5 dense).
            scale = float(tensor.abs().max())
            torch.testing.assert_close(tensors_2[name], tensor, rtol=1e-3, atol=1e-3 * scale, msg=name)
            continue
        # AdamW's first steps move every weight by about lr (1e-2) whatever its gradient's size, so a gradient
        # within rounding of 0 may move it a little differently: weights get a looser bound than gradients, and
        # a few such weights of a tensor (the experts' have many near-zero gradients) may differ by up to lr / 20
        # (measured on the mixture-of-experts model: at most 1.2e-4 of a tensor's weights past 5e-5, none past 1.4e-4).
        off = (tensors_2[name] - tensor).abs()
        assert int((off > 5e-5).sum()) <= max(1, tensor.numel() // 2000) and float(off.max()) < 5e-4, name


@pytest.mark.integration
def test_context_parallel_that_does_not_fit_is_refused(tmp_path):
    init_model(tmp_path / "tiny", "tiny")  # 2 query heads, 1 KV head
    with pytest.raises(AsyncRLError, match="trainer.cp = 3 does not divide the 4 trainer ranks"):
        device_meshes("cpu", 4, ep=1, cp=3)
    with pytest.raises(AsyncRLError, match="trainer.ep = 2 is not a multiple of trainer.cp = 4"):
        device_meshes("cpu", 8, ep=2, cp=4)
    native = load_native(str(tmp_path / "tiny"), torch.device("cpu"), torch.float32)
    with pytest.raises(AsyncRLError, match="has 2 query and 1 KV heads: cp must divide both"):
        check_context_parallel(native, 2)
    transformers_model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    with pytest.raises(AsyncRLError, match="set model.impl = 'native'"):
        check_context_parallel(transformers_model, 2)
