"""The paged KV cache's bookkeeping without a model: the block pool's reference counts, block tables, shared
prompts and copy-on-write."""

from __future__ import annotations

import pytest

from asyncrl.inference.engine.block_pool import BlockPool
from asyncrl.inference.engine.block_tables import BlockCopy, BlockTables


def test_a_block_is_free_again_once_the_last_table_releases_it():
    pool = BlockPool(3)
    [block] = pool.take(1)
    pool.share(block)
    assert (pool.num_free, pool.refs(block)) == (2, 2)
    pool.release(block)
    assert pool.num_free == 2
    pool.release(block)
    assert pool.num_free == 3 and pool.refs(block) == 0


def test_taking_more_blocks_than_are_free_or_releasing_twice_is_a_bug():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="3 KV-cache blocks asked for, 2 free"):
        pool.take(3)
    [block] = pool.take(1)
    pool.release(block)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(block)
    with pytest.raises(RuntimeError, match="cannot be shared"):
        pool.share(block)


def test_a_table_holds_the_blocks_of_its_positions_and_grows_one_block_at_a_time():
    tables = BlockTables(BlockPool(4), block_size=4)
    tables.allocate("a", 5)  # positions 0-4: two blocks
    assert len(tables.table("a")) == 2
    assert tables.slot("a", 6) == tables.table("a")[1] * 4 + 2
    assert tables.blocks_to_write("a", 7) == 0  # inside its last block
    assert tables.blocks_to_write("a", 8) == 1  # past its end
    assert tables.prepare_write("a", 8) is None
    assert len(tables.table("a")) == 3 and tables.pool.num_free == 1
    tables.free("a")
    assert tables.pool.num_free == 4 and len(tables) == 0


def test_samples_share_their_prompt_and_copy_its_last_block_when_they_write_into_it():
    pool = BlockPool(8)
    tables = BlockTables(pool, block_size=4)
    tables.allocate("first", 6)  # a prompt of 6 tokens: one full block and one holding 2 positions
    tables.share("first", "second")
    tables.share("first", "third")
    full, last = tables.table("first")
    assert pool.num_used == 2 and pool.refs(full) == pool.refs(last) == 3
    # Position 6, the first sampled token, goes into the shared last block: each writer but the last copies it.
    copy = tables.prepare_write("second", 6)
    assert copy == BlockCopy(last, tables.table("second")[1]) and copy.target != last
    assert tables.blocks_to_write("third", 6) == 1
    tables.prepare_write("third", 6)
    assert tables.blocks_to_write("first", 6) == 0 and tables.prepare_write("first", 6) is None
    assert tables.table("first") == [full, last]
    assert pool.refs(full) == 3 and pool.refs(last) == 1 and pool.num_used == 4  # the full block stays shared
    for owner in ("first", "second", "third"):
        tables.free(owner)
    assert pool.num_free == 8


def test_a_prompt_that_fills_its_blocks_is_shared_with_no_copy():
    tables = BlockTables(BlockPool(4), block_size=4)
    tables.allocate("first", 4)
    tables.share("first", "second")
    assert tables.prepare_write("second", 4) is None and tables.prepare_write("first", 4) is None
    assert tables.table("first")[0] == tables.table("second")[0]
    assert tables.table("first")[1] != tables.table("second")[1]
