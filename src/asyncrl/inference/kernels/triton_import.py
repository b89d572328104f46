"""Triton where it is installed: one place that says whether the GPU kernels (`decode_attention.py`,
`decode_heads.py`, `sampling_kernel.py`) can be defined. A CUDA build of torch brings Triton; a CPU-only
one has none, and the engine then uses torch's operations instead. With `TRITON_INTERPRET=1` (read when
the kernels are defined) the kernels run on CPU tensors: how the unit tests check them without a GPU."""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

AVAILABLE = triton is not None
INTERPRETED = AVAILABLE and os.environ.get("TRITON_INTERPRET") == "1"

__all__ = ["AVAILABLE", "INTERPRETED", "tl", "triton"]
