"""Which device each process of a run gets (placement.py), for every combination of the deployment's devices,
replicas and trainer ranks against 0, 1, 2 and 4 visible GPUs. The GPU count is given, so this runs on a CPU.

A cell reads "inference replicas | trainer ranks": `c` is the CPU, a number the GPU's index; `!` is refused.
"""

from __future__ import annotations

import itertools

import pytest

from asyncrl.errors import AsyncRLError
from asyncrl.placement import Placement, place, rank_device

GPUS = (0, 1, 2, 4)
# inference_device, trainer_device, replicas, ranks, then the cell for 0, 1, 2 and 4 GPUs
TABLE = [
    ("cpu", "cpu", 1, 1, "c | c", "c | c", "c | c", "c | c"),
    ("cpu", "cpu", 1, 2, "c | c c", "c | c c", "c | c c", "c | c c"),
    ("cpu", "cpu", 2, 1, "c c | c", "c c | c", "c c | c", "c c | c"),
    ("cpu", "cpu", 2, 2, "c c | c c", "c c | c c", "c c | c c", "c c | c c"),
    ("cpu", "cuda", 1, 1, "!", "c | 0", "c | 0", "c | 0"),
    ("cpu", "cuda", 1, 2, "!", "!", "c | 0 1", "c | 0 1"),
    ("cpu", "cuda", 2, 1, "!", "c c | 0", "c c | 0", "c c | 0"),
    ("cpu", "cuda", 2, 2, "!", "!", "c c | 0 1", "c c | 0 1"),
    ("cpu", "cuda:1", 1, 1, "!", "!", "c | 1", "c | 1"),
    ("cpu", "cuda:1", 1, 2, "!", "!", "!", "c | 1 2"),
    ("cpu", "cuda:1", 2, 1, "!", "!", "c c | 1", "c c | 1"),
    ("cpu", "cuda:1", 2, 2, "!", "!", "!", "c c | 1 2"),
    ("cuda", "cpu", 1, 1, "!", "0 | c", "0 | c", "0 | c"),
    ("cuda", "cpu", 1, 2, "!", "0 | c c", "0 | c c", "0 | c c"),
    ("cuda", "cpu", 2, 1, "!", "0 0 | c", "0 1 | c", "0 1 | c"),
    ("cuda", "cpu", 2, 2, "!", "0 0 | c c", "0 1 | c c", "0 1 | c c"),
    ("cuda", "cuda", 1, 1, "!", "0 | 0", "0 | 1", "0 | 1"),
    ("cuda", "cuda", 1, 2, "!", "!", "!", "0 | 1 2"),
    ("cuda", "cuda", 2, 1, "!", "0 0 | 0", "!", "0 1 | 2"),
    ("cuda", "cuda", 2, 2, "!", "!", "!", "0 1 | 2 3"),
    ("cuda", "cuda:1", 1, 1, "!", "!", "0 | 1", "0 | 1"),
    ("cuda", "cuda:1", 1, 2, "!", "!", "!", "0 | 1 2"),
    ("cuda", "cuda:1", 2, 1, "!", "!", "!", "0 2 | 1"),
    ("cuda", "cuda:1", 2, 2, "!", "!", "!", "0 3 | 1 2"),
    ("cuda:1", "cpu", 1, 1, "!", "!", "1 | c", "1 | c"),
    ("cuda:1", "cpu", 1, 2, "!", "!", "1 | c c", "1 | c c"),
    ("cuda:1", "cpu", 2, 1, "!", "!", "!", "1 2 | c"),
    ("cuda:1", "cpu", 2, 2, "!", "!", "!", "1 2 | c c"),
    ("cuda:1", "cuda", 1, 1, "!", "!", "1 | 0", "1 | 0"),
    ("cuda:1", "cuda", 1, 2, "!", "!", "!", "1 | 0 2"),
    ("cuda:1", "cuda", 2, 1, "!", "!", "!", "1 2 | 0"),
    ("cuda:1", "cuda", 2, 2, "!", "!", "!", "1 2 | 0 3"),
    ("cuda:1", "cuda:1", 1, 1, "!", "!", "1 | 1", "1 | 1"),
    ("cuda:1", "cuda:1", 1, 2, "!", "!", "!", "1 | 1 2"),
    ("cuda:1", "cuda:1", 2, 1, "!", "!", "!", "1 2 | 1"),
    ("cuda:1", "cuda:1", 2, 2, "!", "!", "!", "1 2 | 1 2"),
]
CASES = [(*row[:4], gpus, cell) for row in TABLE for gpus, cell in zip(GPUS, row[4:])]


def cell(inference: str, trainer: str, replicas: int, ranks: int, gpus: int) -> str:
    try:
        placed = place(inference, trainer, replicas, ranks, gpus)
    except AsyncRLError:
        return "!"
    short = lambda devices: " ".join("c" if d == "cpu" else d.removeprefix("cuda:") for d in devices)  # noqa: E731
    return f"{short(placed.inference)} | {short(placed.trainer)}"


@pytest.mark.parametrize(("inference", "trainer", "replicas", "ranks", "gpus", "expected"), CASES)
def test_every_process_gets_the_device_of_the_table(inference, trainer, replicas, ranks, gpus, expected):
    assert cell(inference, trainer, replicas, ranks, gpus) == expected


def test_the_table_holds_every_combination():
    devices = ("cpu", "cuda", "cuda:1")
    assert {row[:4] for row in TABLE} == set(itertools.product(devices, devices, (1, 2), (1, 2)))


@pytest.mark.parametrize("gpus", GPUS)
def test_auto_is_cuda_with_a_gpu_and_the_cpu_without(gpus):
    meant = "cuda" if gpus else "cpu"
    for other, replicas, ranks in itertools.product(("cpu", "cuda", "cuda:1"), (1, 2), (1, 2)):
        assert cell("auto", other, replicas, ranks, gpus) == cell(meant, other, replicas, ranks, gpus)
        assert cell(other, "auto", replicas, ranks, gpus) == cell(other, meant, replicas, ranks, gpus)


def test_a_trainer_on_gpu_n_puts_rank_r_on_gpu_n_plus_r():
    placed = place("cpu", "cuda:1", 1, 2, gpus=4)
    assert placed.trainer == ("cuda:1", "cuda:2")
    assert placed.trainer_device == "cuda"
    assert placed.trainer_env() == {"CUDA_VISIBLE_DEVICES": "1,2"}  # local rank r computes on cuda:r


def test_the_trainers_gpus_are_named_as_the_launchers_own_visible_devices_name_them():
    placed = place("cuda", "cuda", 1, 2, gpus=3)
    assert placed.trainer_env("4,6,7") == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert Placement(("cpu",), ("cpu",)).trainer_env("4,6,7") == {}


def test_a_cuda_device_without_a_gpu_is_refused_naming_the_key_and_the_fix():
    with pytest.raises(AsyncRLError) as error:
        place("cpu", "cuda", 1, 1, gpus=0)
    assert str(error.value) == (
        "deployment.trainer_device = 'cuda', but torch sees no CUDA GPU here (set deployment.trainer_device = "
        "'cpu', or 'auto')"
    )


def test_two_trainer_ranks_on_one_gpu_are_refused():
    with pytest.raises(AsyncRLError, match="deployment.trainer_ranks = 2 on one GPU: NCCL needs a GPU per rank"):
        place("cpu", "cuda", 1, 2, gpus=1)


def test_more_processes_than_gpus_names_what_is_left_and_the_fix():
    with pytest.raises(AsyncRLError) as error:
        place("cuda", "cuda", 2, 1, gpus=2)
    assert str(error.value) == (
        "deployment.trainer_ranks = 1 needs 1 GPU(s) of their own, and 0 of the 2 visible are left after the "
        "inference's cuda:0, cuda:1 (lower deployment.trainer_ranks, or set deployment.inference_device and "
        "deployment.trainer_device to share GPUs)"
    )


def test_an_explicit_gpu_past_the_last_is_refused():
    with pytest.raises(AsyncRLError, match=r"'cuda:1' puts 2 inference replica\(s\) on GPUs 1..2, and 2 are visible"):
        place("cuda:1", "cpu", 2, 1, gpus=2)


def test_a_setting_that_is_no_device_is_refused():
    with pytest.raises(AsyncRLError, match="deployment.inference_device = 'gpu' is not a device"):
        place("gpu", "cpu", 1, 1, gpus=0)


@pytest.mark.parametrize(
    ("device", "local_rank", "gpus", "expected"),
    [("cpu", 1, 2, "cpu"), ("auto", 0, 0, "cpu"), ("auto", 1, 2, "cuda:1"), ("cuda", 1, 2, "cuda:1"),
     ("cuda:1", 0, 2, "cuda:1"), ("cuda:1", 1, 4, "cuda:2"), ("cuda:1", 1, 2, "!"), ("cuda", 0, 0, "!")],
)  # fmt: skip
def test_a_process_started_by_itself_takes_its_local_ranks_gpu(device, local_rank, gpus, expected):
    try:
        assert rank_device(device, local_rank, gpus) == expected
    except AsyncRLError:
        assert expected == "!"
