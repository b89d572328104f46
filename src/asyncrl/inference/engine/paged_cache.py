"""The paged KV cache: keys and values in fixed-size blocks from one pool, preallocated once.

Layout [layer, block, position in block, kv head, head dim], so that a layer's blocks read as one run of
blocks x block_size positions (`flat`), where position p of a sequence sits at `BlockTables.slot`. A
sequence holds only the blocks its tokens fill (`block_tables.py`), so short samples leave room for more
of them than `seq_len` slots would; `max_sequences` bounds the decoding batch (row buffers), not memory.

As in `kv_cache.py`, the cache starts zeroed and only ever receives finite keys and values, so the masked
positions attention gathers (past a row's length, or from block 0 where a row has no block) weigh exactly 0.
One block more than the pool hands out is allocated, `scratch_block`: the rows that pad a batch to a
captured CUDA graph's size (and the warm-up) write there, never into a block a sequence may hold.
"""

from __future__ import annotations

import torch

from asyncrl.errors import AsyncRLError
from asyncrl.inference.engine.kv_cache import GIB


def blocks_for_budget(budget_bytes: float, block_size: int, token_bytes: int, max_len: int) -> int:
    """How many blocks of `block_size` tokens fit in the budget; at least one sequence of `max_len` or an error."""
    block_bytes = block_size * token_bytes
    blocks = int(budget_bytes // block_bytes)
    needed = -(-max_len // block_size)
    if blocks < needed:
        raise AsyncRLError(
            f"the KV-cache budget ({budget_bytes / GIB:.3f} GiB) holds {blocks} blocks of {block_size} tokens, "
            f"fewer than one sequence of seq_len {max_len} tokens needs ({needed}) (raise inference.kv_cache_gb "
            "or lower inference.seq_len)"
        )
    return blocks


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        max_len: int,
        max_sequences: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks  # the pool's; block `num_blocks` is the scratch block
        self.scratch_block = num_blocks
        self.block_size = block_size
        self.max_len = max_len  # seq_len: the longest sequence, which sizes the rotary tables
        self.max_sequences = max_sequences

    @property
    def max_blocks(self) -> int:
        """Blocks of the longest sequence: the width of a block table."""
        return -(-self.max_len // self.block_size)

    @property
    def total_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values as [blocks x block_size, kv heads, head dim] views."""
        keys, values = self.keys[layer], self.values[layer]
        return keys.flatten(0, 1), values.flatten(0, 1)

    def copy_block(self, source: int, target: int) -> None:
        """Block `source`'s keys and values into block `target`, in every layer (copy-on-write)."""
        self.keys[:, target] = self.keys[:, source]
        self.values[:, target] = self.values[:, source]
