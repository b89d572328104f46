"""The prefix cache's bookkeeping without a model: block keys, cached blocks found by their tokens, reused
least recently released first when no block is free, every key dropped at once, reference counts back to
zero; the scheduler's prefill starts, shared prompts, admission cost, registration and cache epochs."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.config.schema import InferenceConfig
from asyncrl.inference.engine.block_pool import BlockPool, block_key
from asyncrl.inference.engine.block_tables import BlockTables
from asyncrl.inference.engine.scheduler import Scheduler
from asyncrl.inference.engine.sequence import GenerationRequest, PendingRequest

BLOCK = 4


def tables_of(num_blocks: int) -> BlockTables:
    return BlockTables(BlockPool(num_blocks), BLOCK)


def test_a_key_names_the_whole_prefix_not_only_the_blocks_tokens():
    first = block_key(None, (1, 2, 3, 4))
    assert block_key(None, (1, 2, 3, 4)) == first
    assert block_key(first, (5, 6, 7, 8)) == block_key(block_key(None, (1, 2, 3, 4)), (5, 6, 7, 8))
    assert block_key(first, (5, 6, 7, 8)) != block_key(block_key(None, (9, 2, 3, 4)), (5, 6, 7, 8))
    assert block_key(None, (5, 6, 7, 8)) != block_key(first, (5, 6, 7, 8))


def test_registered_blocks_stay_cached_when_released_and_are_found_by_their_tokens():
    tables = tables_of(8)
    pool = tables.pool
    prompt = list(range(10))  # two full blocks and two positions
    tables.allocate("a", len(prompt))
    tables.register("a", prompt)  # the full blocks only
    full = tables.table("a")[:2]
    tables.free("a")
    assert (pool.num_free, pool.num_cached, pool.num_used) == (8, 2, 0)  # cached blocks count as free
    assert all(pool.refs(block) == 0 for block in range(8))
    # A prompt that starts with the same 8 tokens finds both blocks; one that differs in block 2 only the first.
    assert tables.cached_prefix(prompt[:8] + [99, 98]) == full
    assert tables.cached_prefix(prompt[:5] + [99] * 5) == full[:1]
    assert tables.cached_prefix([99] + prompt[1:]) == []
    # The last token is always computed (its logits): a prompt of exactly two blocks reuses only the first.
    assert tables.cached_prefix(prompt[:8]) == full[:1]
    assert tables.cached_prefix(prompt[:9]) == full
    # Taking the cached blocks back costs free blocks; holding them while another table does costs none.
    longer = prompt[:8] + [50, 51, 52]
    cached = tables.cached_prefix(longer)
    assert tables.cost(len(longer), cached) == 3
    tables.allocate("b", len(longer), cached)
    assert tables.table("b")[:2] == full and pool.num_cached == 0 and pool.num_used == 3
    assert tables.cost(len(longer), tables.cached_prefix(longer)) == 1
    tables.allocate("c", len(longer), tables.cached_prefix(longer))
    assert [pool.refs(block) for block in full] == [2, 2] and pool.num_used == 4
    tables.free("b")
    tables.free("c")
    assert all(pool.refs(block) == 0 for block in range(8))
    assert pool.num_free == 8 and pool.num_cached == 2


def test_when_no_block_is_free_the_least_recently_released_cached_block_is_reused_and_forgets_its_key():
    tables = tables_of(4)
    pool = tables.pool
    tokens_a, tokens_b = [1] * 9, [2] * 9  # two full blocks each
    tables.allocate("a", 8)
    tables.register("a", tokens_a[:8])
    tables.allocate("b", 8)
    tables.register("b", tokens_b[:8])
    a_blocks, b_blocks = tables.table("a"), tables.table("b")
    tables.free("a")  # released last block first: a's second block is the least recently released
    tables.free("b")
    assert pool.num_free == 4 and pool.num_cached == 4
    [taken] = pool.take(1)
    assert taken == a_blocks[1] and pool.num_cached == 3
    assert tables.cached_prefix(tokens_a) == a_blocks[:1]  # its second block is gone, its first stays
    pool.take(1)
    assert tables.cached_prefix(tokens_a) == [] and tables.cached_prefix(tokens_b) == b_blocks
    # Holding cached blocks takes them out of the reuse order: nothing is left to take.
    tables.allocate("b2", 8, tables.cached_prefix(tokens_b))
    assert pool.num_free == 0 and pool.num_cached == 0
    with pytest.raises(RuntimeError, match="1 KV-cache blocks asked for, 0 free"):
        pool.take(1)


def test_forgetting_the_keys_frees_every_cached_block_and_held_ones_return_to_the_free_list():
    tables = tables_of(6)
    pool = tables.pool
    tokens = list(range(12))
    tables.allocate("held", 12)
    tables.register("held", tokens)
    tables.allocate("gone", 8)
    tables.register("gone", [7] * 8)
    tables.free("gone")
    assert pool.num_cached == 2
    pool.forget_keys()
    assert pool.num_cached == 0 and pool.num_free == 3
    assert tables.cached_prefix(tokens + [0]) == [] and tables.cached_prefix([7] * 9) == []
    tables.free("held")  # its blocks lost their keys: plainly free
    assert pool.num_cached == 0 and pool.num_free == 6
    assert all(pool.refs(block) == 0 for block in range(6))


def test_a_key_or_block_registered_already_stays_as_it_is():
    tables = tables_of(6)
    tokens = [3] * 8
    tables.allocate("a", 8)
    tables.allocate("b", 8)
    tables.register("a", tokens)
    tables.register("b", tokens)  # the same prefix computed twice: the first blocks keep the keys
    assert tables.cached_prefix(tokens + [0]) == tables.table("a")
    tables.free("b")
    assert tables.pool.num_cached == 0 and tables.pool.num_free == 4


def pending(prompt: list[int], n: int = 1, **fields) -> PendingRequest:
    return PendingRequest(GenerationRequest(prompt_ids=prompt, n=n, **fields), seeds=list(range(n)))


def prefix_scheduler(num_blocks: int, prefix_cache: bool = True) -> Scheduler:
    return Scheduler(64, 1000, tables_of(num_blocks), prefix_cache=prefix_cache)


def run_to_end(scheduler: Scheduler, request: PendingRequest, tokens: list[int]) -> None:
    """Admit `request`, register its prefill, give each sample `tokens` and release it."""
    scheduler.add(request.sequences)
    assert scheduler.admit() == request.sequences
    scheduler.register_prefilled(request.sequences[:1])
    for token in tokens:
        for sequence in request.sequences:
            sequence.token_ids.append(token)
        assert not scheduler.reserve()[1]
    scheduler.release(request.sequences)


def test_a_later_prompt_starts_after_the_cached_blocks_and_its_samples_start_there_too():
    scheduler = prefix_scheduler(16)
    prompt = list(range(10, 23))  # 13 tokens: three full blocks
    run_to_end(scheduler, pending(prompt), [1, 2])
    assert scheduler.blocks.pool.num_cached == 3 and scheduler.prefix_hit_tokens == 0
    later = pending(prompt[:12] + [40, 41, 42], n=3)
    scheduler.add(later.sequences)
    assert scheduler.admit() == later.sequences
    assert [s.prefill_start for s in later.sequences] == [12, 12, 12]
    assert [s.cached_tokens for s in later.sequences] == [12, 12, 12]
    assert scheduler.prefix_hit_tokens == 12  # once for the request: its samples share one prefill
    assert scheduler.blocks.pool.num_used == 4  # three cached blocks held again and one fresh
    scheduler.release(later.sequences)
    assert all(scheduler.blocks.pool.refs(block) == 0 for block in range(16))


def test_an_ended_sample_leaves_its_generated_blocks_for_the_next_turn():
    scheduler = prefix_scheduler(16)
    prompt = list(range(6))
    first = pending(prompt)
    run_to_end(scheduler, first, list(range(100, 111)))  # 17 tokens, 16 written: four full blocks
    assert scheduler.blocks.pool.num_cached == 4
    turn2 = pending(prompt + list(range(100, 111)) + [7, 8, 9])
    scheduler.add(turn2.sequences)
    scheduler.admit()
    assert turn2.sequences[0].prefill_start == 16


def test_admission_counts_a_cached_block_no_table_holds_as_one_taken():
    scheduler = prefix_scheduler(5)
    prompt = list(range(9))
    run_to_end(scheduler, pending(prompt), [])
    # running: one sample of 1 block; a new one with the cached 2 of its 3 blocks needs them, 1 fresh and
    # 2 of headroom (6 > 5 free, cached ones included); without them 3 + 2.
    running = pending([5])
    scheduler.add(running.sequences)
    scheduler.admit()
    waiting = pending(prompt)
    scheduler.add(waiting.sequences)
    assert scheduler.blocks.pool.num_free == 4
    assert scheduler.admit() == []
    scheduler.release(running.sequences)
    assert scheduler.admit() == waiting.sequences and waiting.sequences[0].prefill_start == 8


def test_samples_that_record_their_experts_and_a_cache_off_start_from_nothing():
    for scheduler, request in [
        (prefix_scheduler(16), pending(list(range(9)), return_routed_experts=True)),
        (prefix_scheduler(16, prefix_cache=False), pending(list(range(9)))),
    ]:
        run_to_end(scheduler, pending(list(range(9))), [1])
        scheduler.add(request.sequences)
        scheduler.admit()
        assert request.sequences[0].prefill_start == 0 and scheduler.prefix_hit_tokens == 0


def test_new_weights_drop_the_cache_and_samples_admitted_before_them_register_nothing():
    scheduler = prefix_scheduler(16)
    prompt = list(range(9))
    old = pending(prompt)
    scheduler.add(old.sequences)
    scheduler.admit()
    scheduler.register_prefilled(old.sequences)
    scheduler.forget_prefixes()  # a weight update while `old` decodes
    assert scheduler.blocks.cached_prefix(prompt) == []
    old.sequences[0].token_ids.extend(range(100, 110))
    scheduler.release(old.sequences)
    assert scheduler.blocks.pool.num_cached == 0 and scheduler.blocks.pool.num_free == 16
    new = pending(prompt)
    scheduler.add(new.sequences)
    scheduler.admit()
    assert new.sequences[0].prefill_start == 0


def test_a_preempted_sample_registers_what_it_wrote_and_its_recompute_starts_from_it():
    scheduler = prefix_scheduler(6)
    old, new = pending([1] * 4), pending(list(range(20, 24)))
    scheduler.add([*old.sequences, *new.sequences])
    assert scheduler.admit() == [*old.sequences, *new.sequences]
    scheduler.register_prefilled(scheduler.running)
    for step in range(9):
        for sequence in scheduler.running:
            sequence.token_ids.append(30 + step)
        copies, preempted = scheduler.reserve()
        if preempted:
            break
    assert preempted == new.sequences
    victim = new.sequences[0]
    written = victim.num_tokens - 1
    scheduler.release(old.sequences)
    assert scheduler.admit() == new.sequences
    # Its 12 written positions were registered (the reserve that preempted it then reused the last of those
    # blocks for `old`); a prefill computes its last position at least: 8 from the cache.
    assert written == 12 and victim.prefill_start == 8
    assert victim.cached_tokens == 0  # the prompt tokens its first prefill read from the cache


def test_the_prefix_cache_needs_the_paged_layout():
    with pytest.raises(ValidationError, match="prefix_cache = true keeps KV-cache blocks, which only"):
        InferenceConfig(prefix_cache=True)
    assert InferenceConfig(prefix_cache=True, kv_cache_layout="paged").prefix_cache
