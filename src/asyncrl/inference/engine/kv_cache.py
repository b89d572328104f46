"""The KV cache: keys and values of every running sample, preallocated once, in slots of `max_len` tokens.

One slot per sample: layout [layer, slot, position, kv head, head dim] (token-major, as flash attention
reads keys), so the slots [0, batch) of a layer are one strided view that attention reads in place.
Memory is claimed up front from a budget, so a busy server never runs out mid-step: samples that find no
free slot wait (see `scheduler.py`).

The cache starts zeroed and only ever receives finite keys and values: positions past a sample's length
are masked out of attention, and a masked zero times a weight of zero stays zero (garbage could be NaN).
"""

from __future__ import annotations

import torch

from asyncrl.errors import AsyncRLError

GIB = 1 << 30


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Key + value of one token over all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def slots_for_budget(budget_bytes: float, max_len: int, token_bytes: int, max_slots: int) -> int:
    """How many slots of `max_len` tokens fit in the budget, at most `max_slots`; at least one or an error."""
    slot_bytes = max_len * token_bytes
    slots = min(max_slots, int(budget_bytes // slot_bytes))
    if slots < 1:
        raise AsyncRLError(
            f"the KV-cache budget ({budget_bytes / GIB:.3f} GiB) holds no sequence of seq_len {max_len} tokens "
            f"({slot_bytes / GIB:.3f} GiB each) (raise inference.kv_cache_gb or lower inference.seq_len)"
        )
    return slots


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_len = max_len

    @property
    def total_tokens(self) -> int:
        return self.num_slots * self.max_len

    @property
    def max_sequences(self) -> int:
        """Samples decoded together, at most: one per slot."""
        return self.num_slots

    def move(self, source: int, target: int, length: int, start: int = 0) -> None:
        """Copy positions [start, length) of slot `source` into slot `target`, in every layer."""
        self.keys[:, target, start:length] = self.keys[:, source, start:length]
        self.values[:, target, start:length] = self.values[:, source, start:length]
