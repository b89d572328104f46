"""Which device each process of a run computes on: `place` decides it for `asyncrl rl`, `rank_device` for one
trainer rank or server, `node_device` for a cluster node; nothing else in asyncrl picks a GPU.

A device setting is 'auto', 'cpu', 'cuda' or 'cuda:N'. 'auto' is 'cuda' when a GPU is visible, else 'cpu'.
'cuda:N' is explicit: replica i on GPU N + i, trainer rank r on GPU N + r, shared with the other side if the
indices meet (as asked). 'cuda' lets the launcher choose: with one GPU, every automatic process shares it;
with more, each automatic process gets a GPU of its own, among those the explicit side left (inference
first). Trainer ranks never share a GPU with each other: NCCL refuses two ranks on one device.

GPU indices here are those the launcher sees (after its own CUDA_VISIBLE_DEVICES). An inference server is
given its GPU as 'cuda:N'; the trainer is given 'cuda' and a CUDA_VISIBLE_DEVICES listing its GPUs in rank
order, so that local rank r computes on cuda:r.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from asyncrl.errors import AsyncRLError

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class Placement:
    inference: tuple[str, ...]  # per replica: 'cpu' or 'cuda:N'
    trainer: tuple[str, ...]  # per rank: 'cpu' or 'cuda:N'

    @property
    def trainer_device(self) -> str:
        """The trainer's config device: 'cuda' (rank r on its cuda:r, see trainer_env) or 'cpu'."""
        return "cpu" if self.trainer[0] == "cpu" else "cuda"

    def trainer_env(self, visible: str | None = None) -> dict[str, str]:
        """CUDA_VISIBLE_DEVICES for torchrun's ranks: the trainer's GPUs in rank order, as the launcher's own
        CUDA_VISIBLE_DEVICES (`visible`, if set) names them."""
        if self.trainer_device == "cpu":
            return {}
        names = [name.strip() for name in visible.split(",")] if visible else None
        gpus = [int(device[5:]) for device in self.trainer]
        return {"CUDA_VISIBLE_DEVICES": ",".join(names[gpu] if names else str(gpu) for gpu in gpus)}


def place(inference_device: str, trainer_device: str, replicas: int, ranks: int, gpus: int) -> Placement:
    """The device of every inference replica and trainer rank, or an AsyncRLError naming the conflict."""
    inference = _setting("deployment.inference_device", inference_device, gpus)
    trainer = _setting("deployment.trainer_device", trainer_device, gpus)
    taken: set[int] = set()
    placed: dict[str, list[str]] = {}
    for side, setting, count in (("inference", inference, replicas), ("trainer", trainer, ranks)):
        if setting == "cpu":
            placed[side] = ["cpu"] * count
        elif setting.startswith("cuda:"):
            placed[side] = _explicit(side, int(setting[5:]), count, gpus)
            taken.update(int(device[5:]) for device in placed[side])
    for side, setting, count in (("inference", inference, replicas), ("trainer", trainer, ranks)):
        if setting == "cuda":
            placed[side] = _automatic(side, count, gpus, taken, placed)
            taken.update(int(device[5:]) for device in placed[side])
    return Placement(tuple(placed["inference"]), tuple(placed["trainer"]))


def rank_device(device: str, local_rank: int, gpus: int) -> str:
    """The device of one process started by itself (`asyncrl trainer` under torchrun, `asyncrl inference`):
    'auto' and 'cuda' give local rank r cuda:r, 'cuda:N' gives it cuda:N + r; 'cpu' where no GPU is visible."""
    setting = _setting("device", device, gpus)
    if setting == "cpu":
        return "cpu"
    gpu = local_rank + (int(setting[5:]) if setting.startswith("cuda:") else 0)
    if gpu >= gpus:
        raise AsyncRLError(
            f"rank {local_rank} with device = '{device}' needs cuda:{gpu}, and {gpus} GPU(s) are visible "
            "(start fewer ranks, or set device = 'cpu')"
        )
    return f"cuda:{gpu}"


def visible_gpus() -> int:
    """The GPUs torch sees here (imports torch: ask only when a device other than the CPU may be wanted)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def node_device(gpus_per_node: int) -> str:
    """The device of every process of a cluster node: each server sees only its own GPU (Slurm's
    --gpus-per-task, a pod's GPU limit) and each trainer rank takes cuda:local_rank, so 'cuda' says it all."""
    return "cuda" if gpus_per_node else "cpu"


def _setting(key: str, device: str, gpus: int) -> str:
    if not _DEVICE.fullmatch(device):
        raise AsyncRLError(f"{key} = '{device}' is not a device (use 'auto', 'cpu', 'cuda' or 'cuda:N')")
    if device == "auto":
        return "cuda" if gpus else "cpu"
    if device.startswith("cuda") and gpus == 0:
        raise AsyncRLError(f"{key} = '{device}', but torch sees no CUDA GPU here (set {key} = 'cpu', or 'auto')")
    return device


def _explicit(side: str, first: int, count: int, gpus: int) -> list[str]:
    if first + count > gpus:
        what = "inference replica" if side == "inference" else "trainer rank"
        raise AsyncRLError(
            f"deployment.{side}_device = 'cuda:{first}' puts {count} {what}(s) on GPUs {first}..{first + count - 1}, "
            f"and {gpus} are visible (lower the index or deployment.{_count_key(side)})"
        )
    return [f"cuda:{first + i}" for i in range(count)]


def _automatic(side: str, count: int, gpus: int, taken: set[int], placed: dict[str, list[str]]) -> list[str]:
    free = [gpu for gpu in range(gpus) if gpu not in taken]
    if len(free) >= count:
        return [f"cuda:{gpu}" for gpu in free[:count]]
    if gpus == 1 and (side == "inference" or count == 1):
        return ["cuda:0"] * count  # one GPU: every automatic process shares it
    if gpus == 1:
        raise AsyncRLError(
            f"deployment.trainer_ranks = {count} on one GPU: NCCL needs a GPU per rank (set "
            "deployment.trainer_ranks = 1, or deployment.trainer_device = 'cpu')"
        )
    other = "trainer" if side == "inference" else "inference"
    held = sorted({device for device in placed.get(other, []) if device != "cpu"})
    after = f" after the {other}'s {', '.join(held)}" if held else ""
    raise AsyncRLError(
        f"deployment.{_count_key(side)} = {count} needs {count} GPU(s) of their own, and {len(free)} of the {gpus} "
        f"visible are left{after} (lower deployment.{_count_key(side)}, or set deployment.inference_device and "
        "deployment.trainer_device to share GPUs)"
    )


def _count_key(side: str) -> str:
    return "inference_replicas" if side == "inference" else "trainer_ranks"
