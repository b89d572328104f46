"""The scheduler (slots and paged layouts), the request bookkeeping and the CUDA-graph buckets, without a
model."""

from __future__ import annotations

from concurrent.futures import Future

from asyncrl.inference.engine.block_pool import BlockPool
from asyncrl.inference.engine.block_tables import BlockTables
from asyncrl.inference.engine.cuda_graphs import bucket
from asyncrl.inference.engine.scheduler import Scheduler, SlotMove, prefill_length
from asyncrl.inference.engine.sequence import GenerationRequest, PendingRequest


def pending(n: int, prompt_len: int = 1) -> PendingRequest:
    return PendingRequest(GenerationRequest(prompt_ids=[1] * prompt_len, n=n), seeds=list(range(n)))


def scheduler_with(*requests: PendingRequest, num_slots: int = 8, max_prefill_tokens: int = 1000) -> Scheduler:
    scheduler = Scheduler(num_slots, max_prefill_tokens)
    for request in requests:
        scheduler.add(request.sequences)
    return scheduler


def test_admission_is_first_come_first_served_into_free_slots():
    a, b, c = pending(2), pending(2), pending(2)
    scheduler = scheduler_with(a, b, c, num_slots=3)
    assert scheduler.admit() == [*a.sequences, b.sequences[0]]
    assert scheduler.running == [*a.sequences, b.sequences[0]]  # slot i holds running[i]
    assert scheduler.admit() == [] and scheduler.num_waiting == 3  # no free slot: wait, do not fail


def test_a_finished_sample_frees_its_slot_for_the_next_waiting_one():
    a, b = pending(3), pending(1)
    scheduler = scheduler_with(a, b, num_slots=3)
    scheduler.admit()
    moves = scheduler.release([a.sequences[0]])
    # The sample past the new end fills the hole, so the running samples stay in slots [0, 2).
    assert moves == [SlotMove(2, 0, a.sequences[2])]
    assert scheduler.running == [a.sequences[2], a.sequences[1]]
    assert scheduler.admit() == b.sequences and scheduler.running[2] is b.sequences[0]


def test_releasing_several_samples_keeps_slots_dense():
    requests = [pending(1) for _ in range(5)]
    scheduler = scheduler_with(*requests)
    scheduler.admit()
    s = [r.sequences[0] for r in requests]
    moves = scheduler.release([s[1], s[4], s[2]])
    assert scheduler.running == [s[0], s[3]]
    assert moves == [SlotMove(3, 1, s[3])]  # slot 4 was last and leaves; slot 2 is past the new end


def test_one_prefill_is_bounded_by_the_prefill_token_budget():
    a, b, c = pending(2, prompt_len=40), pending(1, prompt_len=40), pending(1, prompt_len=10)
    scheduler = scheduler_with(a, b, c, max_prefill_tokens=80)
    # a's two samples share one prompt row (40 tokens); b adds a second row: 2 x 40; c would make 3 x 40.
    assert scheduler.admit() == [*a.sequences, *b.sequences]
    assert scheduler.admit() == c.sequences


def test_a_prompt_longer_than_the_prefill_budget_still_runs_alone():
    a = pending(1, prompt_len=500)
    assert scheduler_with(a, max_prefill_tokens=100).admit() == a.sequences


def test_cancelled_requests_are_skipped():
    cancelled, kept = pending(2), pending(1)
    scheduler = scheduler_with(cancelled, kept)
    assert cancelled.future.cancel()
    assert scheduler.admit() == kept.sequences


def test_request_resolves_when_all_its_samples_finish():
    request = pending(2)
    for sequence, reason in zip(request.sequences, ("stop", "length")):
        sequence.token_ids.append(7)
        sequence.finish_reason = reason
    request.sequence_finished()
    assert not request.future.done()
    request.sequence_finished()
    assert [c.finish_reason for c in request.future.result()] == ["stop", "length"]


def test_a_cancelled_request_ignores_late_results():
    request = pending(1)
    request.future.cancel()
    request.sequences[0].finish_reason = "stop"
    request.sequence_finished()  # must not raise in the decoding thread
    request.fail(RuntimeError("late"))
    assert isinstance(request.future, Future) and request.future.cancelled()


def test_graph_buckets_pad_at_most_a_quarter_and_respect_the_limit():
    assert [bucket(n, 1000) for n in (1, 2, 3, 5, 8, 9, 17, 33, 129, 130)] == [1, 2, 4, 8, 8, 10, 20, 40, 160, 160]
    assert all(n <= bucket(n, 10_000) <= max(8, n * 1.25) for n in range(1, 3000))
    assert bucket(300, 256) == 256


def paged_scheduler_with(*requests: PendingRequest, num_blocks: int, block_size: int = 4) -> Scheduler:
    scheduler = Scheduler(64, 1000, BlockTables(BlockPool(num_blocks), block_size))
    for request in requests:
        scheduler.add(request.sequences)
    return scheduler


def decode_once(scheduler: Scheduler, token: int = 7) -> None:
    """What a decoding step does to the running samples: each gets one token more."""
    for sequence in scheduler.running:
        sequence.token_ids.append(token)


def test_paged_admission_goes_by_free_blocks_with_one_block_of_headroom_per_sample():
    a, b, c = pending(1, prompt_len=6), pending(1, prompt_len=6), pending(1, prompt_len=6)
    scheduler = paged_scheduler_with(a, b, c, num_blocks=6)
    # a alone takes its 2 prompt blocks; b needs 2 more + headroom for a's and its own next token (6 in all);
    # c would need 2 + 3.
    assert scheduler.admit() == [*a.sequences, *b.sequences]
    assert scheduler.blocks.pool.num_free == 2
    assert scheduler.admit() == []
    scheduler.release(a.sequences)
    assert scheduler.admit() == c.sequences and scheduler.running == [*b.sequences, *c.sequences]


def test_the_samples_of_a_request_admitted_together_hold_its_prompt_once():
    request = pending(4, prompt_len=6)
    scheduler = paged_scheduler_with(request, num_blocks=8)
    assert scheduler.admit() == request.sequences
    tables = {tuple(scheduler.blocks.table(sequence)) for sequence in request.sequences}
    assert len(tables) == 1 and scheduler.blocks.pool.num_used == 2
    decode_once(scheduler)  # every sample writes its first token into the shared, partly filled last block
    copies, preempted = scheduler.reserve()
    assert len(copies) == 3 and not preempted  # three copies; the last writer keeps the original
    assert {copy.source for copy in copies} == {next(iter(tables))[1]}
    scheduler.release(request.sequences)
    assert scheduler.blocks.pool.num_free == 8


def test_when_blocks_run_out_the_newest_sample_is_preempted_and_waits_first_in_line():
    old, new, later = pending(1, prompt_len=4), pending(1, prompt_len=4), pending(1, prompt_len=2)
    scheduler = paged_scheduler_with(old, new, later, num_blocks=4)
    assert scheduler.admit() == [*old.sequences, *new.sequences]  # 1 + 1 blocks, 2 of headroom
    decode_once(scheduler)  # position 4 starts a block for both: 2 free blocks suffice
    assert scheduler.reserve() == ([], [])
    for _ in range(4):
        decode_once(scheduler)
    # Position 8 needs a third block each; only one is left (and `later` could not join).
    copies, preempted = scheduler.reserve()
    assert preempted == new.sequences and scheduler.running == old.sequences
    assert list(scheduler.waiting) == [*new.sequences, *later.sequences]
    assert scheduler.preemptions == 1 and scheduler.blocks.pool.num_used == 3
    # Readmitted once blocks are free, it prefills all it had but its newest token, which decoding feeds.
    scheduler.release(old.sequences)
    assert scheduler.admit()[0] is new.sequences[0]
    assert prefill_length(new.sequences[0]) == 4 + 5 - 1
    assert len(scheduler.blocks.table(new.sequences[0])) == 2


def test_the_newest_sample_preempts_itself_when_it_needs_the_block():
    old, new = pending(1, prompt_len=2), pending(1, prompt_len=4)
    scheduler = paged_scheduler_with(old, new, num_blocks=4)
    assert scheduler.admit() == [*old.sequences, *new.sequences]
    for _ in range(4):  # new starts its second block at position 4, old at 4 too: none is left
        decode_once(scheduler)
        assert scheduler.reserve() == ([], [])
    assert scheduler.blocks.pool.num_free == 0
    decode_once(scheduler)
    decode_once(scheduler)
    _, preempted = scheduler.reserve()  # new's position 9 needs a third block, old's 7 none
    assert preempted == new.sequences and scheduler.running == old.sequences


def test_clearing_a_paged_batch_frees_every_block():
    scheduler = paged_scheduler_with(pending(3, prompt_len=5), pending(1, prompt_len=9), num_blocks=16)
    scheduler.admit()
    scheduler.clear()
    assert scheduler.blocks.pool.num_free == 16 and len(scheduler.blocks) == 0
