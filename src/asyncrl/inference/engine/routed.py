"""Routed experts on their way to the host: the experts a decoding step sent each row's token to (router replay).

The model runner writes them on the device into one buffer every step overwrites; a step that someone asked
routing of queues a copy of its rows right behind its work (into pinned memory on a GPU), so the next step,
launched before the host reads this one, cannot overwrite them first.
"""

from __future__ import annotations

import numpy as np
import torch


class RoutedCopy:
    def __init__(self, routed: torch.Tensor):
        self.ready = None
        if routed.device.type == "cuda":
            self.rows = torch.empty(routed.shape, dtype=routed.dtype, pin_memory=True)
            self.rows.copy_(routed, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.rows = routed.clone()

    def read(self) -> np.ndarray:
        """[rows, MoE layers, k] int16."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.rows.numpy()
