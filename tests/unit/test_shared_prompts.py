"""Which slot holds a shared prompt, as samples join and leave the batch (with the scheduler's slot moves)."""

from __future__ import annotations

from asyncrl.inference.engine.scheduler import Scheduler
from asyncrl.inference.engine.sequence import GenerationRequest, PendingRequest
from asyncrl.inference.engine.shared_prompts import PromptCopy, SharedPrompts


def pending(n: int, prompt_len: int) -> PendingRequest:
    return PendingRequest(GenerationRequest(prompt_ids=[1] * prompt_len, n=n), seeds=list(range(n)))


def admitted(*requests: PendingRequest, num_slots: int = 16) -> tuple[Scheduler, SharedPrompts, list]:
    scheduler = Scheduler(num_slots, max_prefill_tokens=10_000)
    for request in requests:
        scheduler.add(request.sequences)
    shared = SharedPrompts()
    holders = shared.admit(scheduler.admit())
    return scheduler, shared, holders


def test_the_first_sample_of_each_request_holds_its_prompt_for_the_others():
    a, b, c = pending(3, prompt_len=5), pending(1, prompt_len=7), pending(2, prompt_len=4)
    scheduler, shared, holders = admitted(a, b, c)
    assert holders == [a.sequences[0], b.sequences[0], c.sequences[0]]
    # slots 0-2: a, 3: b, 4-5: c
    assert shared.rows(scheduler.running) == ([0, 0, 0, 3, 4, 4], [0, 5, 5, 0, 0, 4])


def test_samples_admitted_in_a_later_prefill_hold_their_own_copy():
    a = pending(4, prompt_len=6)
    scheduler, shared, _ = admitted(a, num_slots=2)
    shared.leave(set(scheduler.running), scheduler.running)
    scheduler.release(list(scheduler.running))
    assert shared.admit(scheduler.admit()) == [a.sequences[2]]  # the next group's holder
    assert shared.rows(scheduler.running) == ([0, 0], [0, 6])


def test_a_leaving_reader_needs_no_copy_and_a_moved_reader_still_reads_its_holder():
    a, b = pending(3, prompt_len=5), pending(2, prompt_len=9)
    scheduler, shared, _ = admitted(a, b)  # slots: a0 a1 a2 b0 b1
    leaving = {a.sequences[1]}
    assert shared.leave(leaving, scheduler.running) == []
    moves = scheduler.release(list(leaving))  # b1 moves from slot 4 into slot 1
    assert [(m.source, m.target, shared.shared_length(m.sequence)) for m in moves] == [(4, 1, 9)]
    assert shared.rows(scheduler.running) == ([0, 3, 0, 3], [0, 9, 5, 0])


def test_a_leaving_holder_hands_its_prompt_to_the_first_reader_that_stays():
    a = pending(4, prompt_len=5)
    scheduler, shared, _ = admitted(a)  # slots: a0 (holder) a1 a2 a3
    leaving = {a.sequences[0], a.sequences[1]}
    copies = shared.leave(leaving, scheduler.running)
    assert copies == [PromptCopy(source=0, target=2, length=5)]  # before any slot moves
    assert shared.shared_length(a.sequences[2]) == 0  # the new holder holds all of its positions
    moves = scheduler.release(list(leaving))  # a2 -> slot 0, a3 -> slot 1
    assert [(m.source, m.target) for m in moves] == [(2, 0), (3, 1)]
    assert shared.rows(scheduler.running) == ([0, 0], [0, 5])


def test_a_holder_leaving_with_all_its_readers_leaves_nothing_behind():
    a, b = pending(3, prompt_len=5), pending(2, prompt_len=3)
    scheduler, shared, _ = admitted(a, b)
    running = list(scheduler.running)
    # readers before their holder, and after it: both orders of the same departure
    assert shared.leave({running[2], running[0], running[1]}, running) == []
    scheduler.release(running[:3])
    assert shared.rows(scheduler.running) == ([0, 0], [0, 3])
    shared.leave(set(scheduler.running), scheduler.running)
    assert shared._holder == {} and shared._readers == {}
