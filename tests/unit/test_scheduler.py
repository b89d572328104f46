"""The scheduler, the request bookkeeping and the CUDA-graph buckets, without a model."""

from __future__ import annotations

from concurrent.futures import Future

from asyncrl.inference.cuda_graphs import bucket
from asyncrl.inference.scheduler import Scheduler, SlotMove
from asyncrl.inference.sequence import GenerationRequest, PendingRequest


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
