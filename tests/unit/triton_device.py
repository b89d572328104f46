"""Where the Triton kernels' tests run: on a GPU, or on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1`, read when the kernels are defined, so set it before pytest starts)."""

from __future__ import annotations

import os

import pytest
import torch

from asyncrl.inference.kernels.triton_import import AVAILABLE

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def device_or_skip() -> str:
    """The device the calling test module runs on; skips the whole module without triton or either."""
    if not AVAILABLE:
        pytest.skip("triton is not installed", allow_module_level=True)
    if not INTERPRETED and not torch.cuda.is_available():
        pytest.skip("no CUDA device, and TRITON_INTERPRET=1 is not set", allow_module_level=True)
    return "cpu" if INTERPRETED else "cuda"
