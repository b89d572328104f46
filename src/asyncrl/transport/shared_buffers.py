"""Buffers one process allocates and another on the same device maps, with no copy between them: CUDA IPC
handles for GPU memory, torch's shared-memory files for host memory (the CPU analogue, so CI runs the same
code). The colocated weight transfer (transport/broadcast.py) lends trainer rank 0's flat weight buffers to
the inference servers on its GPU this way.

`share` turns tensors into bytes that an unrelated process turns back into tensors over the same memory with
`open_shared`. The owner must keep them alive (and the process running) while anyone reads them.
"""

from __future__ import annotations

import functools
import io
import pickle
from collections.abc import Mapping
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing
from torch.multiprocessing.reductions import rebuild_cuda_tensor

_STORAGE_DEVICE = 6  # the producer's device index among rebuild_cuda_tensor's arguments


def allocate(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer that `share` can lend: GPU memory as it is, host memory moved into a shared file."""
    buffer = torch.empty(numel, dtype=dtype, device=device)
    if device.type == "cuda":
        return buffer
    # Shared memory named by file, which any process can open; torch's default (file descriptors) reaches
    # only this process's children.
    torch.multiprocessing.set_sharing_strategy("file_system")
    return buffer.share_memory_()


def share(buffers: Mapping[str, torch.Tensor]) -> bytes:
    """Handles to `buffers` (from `allocate`) that another process on this host can open."""
    out = io.BytesIO()
    ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump(dict(buffers))
    return out.getvalue()


def open_shared(handles: bytes, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors `share` lent, over the owner's memory; on `device` (the owner's GPU, as this process
    numbers it: the two may number the same GPU differently)."""
    return _Unpickler(io.BytesIO(handles), device).load()


def _rebuild_on(index: int, *args):
    args = list(args)
    if not isinstance(args[_STORAGE_DEVICE], int):
        raise RuntimeError("this torch shares CUDA tensors in a form asyncrl does not know (storage device)")
    args[_STORAGE_DEVICE] = index
    return rebuild_cuda_tensor(*args)


class _Unpickler(pickle.Unpickler):
    """Rebuilds CUDA buffers on this process's index of the GPU they live on."""

    def __init__(self, file: io.BytesIO, device: torch.device):
        super().__init__(file)
        if device.type != "cuda":
            self.index = None
        else:
            self.index = device.index if device.index is not None else torch.cuda.current_device()

    def find_class(self, module: str, name: str):
        found = super().find_class(module, name)
        if found is rebuild_cuda_tensor and self.index is not None:
            return functools.partial(_rebuild_on, self.index)
        return found
