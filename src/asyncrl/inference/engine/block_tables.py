"""Which KV-cache blocks hold each sequence's positions, in the paged layout.

Position p of a sequence lives at offset p % block_size of block `table[p // block_size]` of its table.
The samples of one request admitted together share the blocks of their prompt, the partly filled last one
included; a sample about to write into a block another table still holds first gets a copy of its own
(copy-on-write: `prepare_write`), so the full prompt blocks stay shared for good and the last one is copied
at the first position where the samples differ, their first sampled token. Blocks come from and go back to
a `BlockPool`. Not thread-safe (see `block_pool.py`). Each table is mirrored in an int32 array, so a
decoding step's [batch, blocks] table is filled from arrays (`array`), not from Python lists.

With the prefix cache, a table may start with registered blocks found by the tokens they hold
(`cached_prefix`), and its full blocks are registered once their keys and values are final (`register`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from asyncrl.inference.engine.block_pool import BlockPool, block_key


@dataclass(frozen=True)
class BlockCopy:
    """Copy block `source` into block `target`, in every layer, before the step that writes `target`."""

    source: int
    target: int


class BlockTables:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self._tables: dict[Hashable, list[int]] = {}
        self._arrays: dict[Hashable, np.ndarray] = {}  # each table as int32, kept equal to it

    def blocks_for(self, length: int) -> int:
        """Blocks that hold `length` positions."""
        return -(-length // self.block_size)

    def allocate(self, owner: Hashable, length: int, cached: list[int] | None = None) -> None:
        """A table for positions [0, length) of `owner`: the registered blocks `cached` (`cached_prefix`), then
        fresh ones."""
        cached = cached or []
        for block in cached:
            self.pool.hold(block)
        self._tables[owner] = cached + self.pool.take(self.blocks_for(length) - len(cached))
        self._arrays[owner] = np.array(self._tables[owner], dtype=np.int32)

    def cached_prefix(self, tokens: list[int]) -> list[int]:
        """The registered blocks that hold the longest run of whole blocks `tokens` starts with, the last token
        left out (a prefill computes at least one token, for its logits)."""
        blocks: list[int] = []
        key = None
        for start in range(0, (len(tokens) - 1) // self.block_size * self.block_size, self.block_size):
            key = block_key(key, tuple(tokens[start : start + self.block_size]))
            block = self.pool.lookup(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cost(self, length: int, cached: list[int]) -> int:
        """Free blocks `allocate(_, length, cached)` takes: the fresh ones, and the cached blocks that no table
        holds now (counted free until then)."""
        return self.blocks_for(length) - len(cached) + sum(self.pool.is_cached(block) for block in cached)

    def register(self, owner: Hashable, tokens: list[int]) -> None:
        """Register the full blocks of `owner`'s table holding `tokens`, its first positions, all written."""
        table, key = self._tables[owner], None
        for index in range(len(tokens) // self.block_size):
            key = block_key(key, tuple(tokens[index * self.block_size : (index + 1) * self.block_size]))
            self.pool.register(table[index], key)

    def share(self, source: Hashable, owner: Hashable) -> None:
        """`owner` reads the blocks of `source`'s table (a shared prompt) until it writes into one."""
        table = self._tables[source]
        for block in table:
            self.pool.share(block)
        self._tables[owner] = list(table)
        self._arrays[owner] = self._arrays[source].copy()

    def blocks_to_write(self, owner: Hashable, position: int) -> int:
        """Free blocks `prepare_write(owner, position)` takes: one past the table's end or to copy a shared
        block, else none."""
        index, table = position // self.block_size, self._tables[owner]
        return int(index >= len(table) or self.pool.refs(table[index]) > 1)

    def prepare_write(self, owner: Hashable, position: int) -> BlockCopy | None:
        """Make `position` of `owner` writable: a new block at the table's end, or its own copy of a block
        another table holds (returned: the copy to run before the write). Positions are written in order, so
        only the last block can be new or shared."""
        index, table = position // self.block_size, self._tables[owner]
        if index >= len(table):
            table.extend(self.pool.take(1))
            self._arrays[owner] = np.append(self._arrays[owner], np.int32(table[-1]))
            return None
        block = table[index]
        if self.pool.refs(block) == 1:
            return None
        [copy] = self.pool.take(1)
        self.pool.release(block)
        table[index] = copy
        self._arrays[owner][index] = copy
        return BlockCopy(block, copy)

    def free(self, owner: Hashable) -> None:
        """Let go of `owner`'s blocks, the last first: of a prefix the prefix cache keeps, the blocks nearest
        its end are then the first reused (a block found by its tokens is of use only after its predecessors)."""
        self._arrays.pop(owner, None)
        for block in reversed(self._tables.pop(owner, [])):
            self.pool.release(block)

    def table(self, owner: Hashable) -> list[int]:
        return self._tables[owner]

    def array(self, owner: Hashable) -> np.ndarray:
        """`owner`'s table as an int32 array (read only: the tables change it)."""
        return self._arrays[owner]

    def slot(self, owner: Hashable, position: int) -> int:
        """Where `position` of `owner` sits in the cache read as one run of blocks x block_size positions."""
        return self._tables[owner][position // self.block_size] * self.block_size + position % self.block_size

    def __len__(self) -> int:
        return len(self._tables)
