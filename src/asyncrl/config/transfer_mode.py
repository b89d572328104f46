"""What a weight-transfer mode (`weight_transfer.mode`) means to the code that sets a run up: the launcher,
the cluster layout and its renderers, the config schema and the inference backends ask `transfer_mode(name)`
instead of comparing the name. The objects that carry the weights at run time (a publisher, a source, an
update path) are transfer.py's, made from the same answers.

This module imports nothing heavy: the schema asks it while a config loads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.errors import AsyncRLError


@dataclass(frozen=True)
class TransferMode:
    name: str
    # Trainer rank 0 hosts a process group of its own that every server joins: one port, known to all, and a
    # member rank for each server.
    group: bool
    # Every version is a complete folder on disk, named in each weight update; without, only STABLE (and the
    # last version in full) is written.
    folders: bool
    backends: tuple[str, ...]  # the inference backends that can take weights this way
    # Every server must compute on trainer rank 0's own device (the weights never leave it).
    same_device: bool = False

    def backend_problem(self, backend: str) -> str | None:
        """Why `backend` cannot serve under this mode, or None."""
        if backend in self.backends:
            return None
        takes = [mode.name for mode in MODES.values() if backend in mode.backends]
        return (
            f"weight_transfer.mode = '{self.name}' needs inference.backend = "
            f"{' or '.join(repr(b) for b in self.backends)} (the {backend} backend takes "
            f"{' or '.join(repr(m) for m in takes)} only: use {takes[0]!r})"
        )

    def placement_problem(self, inference: Sequence[str], trainer_rank_0: str) -> str | None:
        """Why servers on `inference` devices cannot take weights from trainer rank 0 on its device, or None."""
        elsewhere = [f"{i} on {device}" for i, device in enumerate(inference) if device != trainer_rank_0]
        if not self.same_device or not elsewhere:
            return None
        return (
            f"weight_transfer.mode = '{self.name}' needs every inference server on trainer rank 0's device "
            f"({trainer_rank_0}), but replica {', '.join(elsewhere)} (set deployment.inference_device and "
            "deployment.trainer_device to one device, or use 'broadcast')"
        )

    def group_port(self, settings: Any, pick_port: Callable[[str], int]) -> int | None:
        """The group's port: `settings.port`, or `pick_port(settings.host)` when that is 0; None without a group."""
        if not self.group:
            return None
        return settings.port or pick_port(settings.host)

    def join(self, servers: Sequence[Any], others: Sequence[Any], pick_port: Callable[[str], int]) -> None:
        """Give every process's config its place in the group: its port (group_port), how many servers it
        holds, and server i its member rank i + 1 (rank 0 is the trainer's). Nothing for a mode without one."""
        port = self.group_port((servers or others)[0].weight_transfer, pick_port)
        if port is None:
            return
        for section in (*servers, *others):
            section.weight_transfer.port = port
            section.weight_transfer.receivers = len(servers)
        for i, server in enumerate(servers):
            server.weight_transfer.rank = i + 1

    def trainer_ports(self, port: int) -> list[tuple[str, int]]:
        """The ports trainer rank 0 listens on for the transfer, by name (a cluster opens them)."""
        return [("weights", port)] if self.group else []


MODES = {
    "filesystem": TransferMode("filesystem", group=False, folders=True, backends=("native", "vllm")),
    "broadcast": TransferMode("broadcast", group=True, folders=False, backends=("native",)),
    # The same group, its buffers lent to servers on trainer rank 0's own GPU (CUDA IPC) instead of sent.
    "colocated": TransferMode("colocated", group=True, folders=False, backends=("native",), same_device=True),
}


def transfer_mode(name: str) -> TransferMode:
    try:
        return MODES[name]
    except KeyError:
        raise AsyncRLError(
            f"weight_transfer.mode = '{name}' is not a transfer mode (use {' or '.join(map(repr, MODES))})"
        ) from None


def fixed_port(host: str) -> int:
    """`pick_port` where every port must be known before the job starts (a cluster): 0 is refused."""
    raise AsyncRLError(
        "weight_transfer.port is 0, and on a cluster the inference servers must know trainer rank 0's port "
        "in advance (set weight_transfer.port, e.g. 29501)"
    )
