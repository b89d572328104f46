"""Routed experts on the wire: the experts a mixture-of-experts policy sent each token to, per MoE layer.

A token's routing is [MoE layers, k] expert ids; a sequence's is an int16 array [tokens, MoE layers, k], -1
where none was recorded (a token the engine never fed through the model, such as a sample's last). JSON
carries it as {"shape": [...], "data": base64 of the little-endian int16 bytes}: at 48 layers x 8 experts
that is 768 bytes a token, a tenth of what a list of numbers would take. `/v1/generate` answers with it,
orchestrator checkpoints store it, and the rollout files carry the packed arrays (`transport/rollouts.py`).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

NOT_RECORDED = -1


def encode(routed: np.ndarray) -> dict[str, Any]:
    array = np.ascontiguousarray(routed, dtype="<i2")
    return {"shape": list(array.shape), "data": base64.b64encode(array.tobytes()).decode("ascii")}


def decode(wire: dict[str, Any]) -> np.ndarray:
    array = np.frombuffer(base64.b64decode(wire["data"]), dtype="<i2")
    return array.reshape(wire["shape"]).astype(np.int16)


def unrecorded(tokens: int, like: np.ndarray) -> np.ndarray:
    """Rows for `tokens` tokens whose routing is unknown, shaped like `like`'s rows."""
    return np.full((tokens, *like.shape[1:]), NOT_RECORDED, dtype=np.int16)
