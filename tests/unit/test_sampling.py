"""The sampler and the scheduler, without a model."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from asyncrl.inference.engine import GenerationRequest, PendingRequest, Scheduler
from asyncrl.inference.sampling import filter_top_k_top_p, sample


def generators(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def rows(values: list[float], count: int = 1) -> torch.Tensor:
    return torch.tensor([values] * count)


def draw(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seeds=(0,), num_top=0):
    count = logits.shape[0]
    return sample(
        logits,
        torch.full((count,), temperature),
        torch.full((count,), top_p),
        torch.full((count,), top_k, dtype=torch.long),
        generators(*seeds),
        num_top,
    )


LOGITS = [2.0, 1.0, 0.5, -1.0, -3.0]


def test_logprob_is_at_the_sampling_temperature_before_top_k():
    out = draw(rows(LOGITS), temperature=0.7, top_k=1)
    assert out.token_ids.tolist() == [0]
    expected = torch.log_softmax(torch.tensor(LOGITS) / 0.7, dim=-1)[0]
    assert torch.allclose(out.logprobs[0], expected)
    assert out.logprobs[0] < -0.05  # the unfiltered probability, not the 1.0 that top-k=1 leaves


def test_draws_follow_the_tempered_distribution():
    count = 4000
    out = draw(rows(LOGITS, count), temperature=2.0, seeds=range(count))
    frequencies = torch.bincount(out.token_ids, minlength=len(LOGITS)).float() / count
    assert torch.allclose(frequencies, torch.softmax(torch.tensor(LOGITS) / 2.0, dim=-1), atol=0.03)


def test_top_k_limits_draws_to_the_k_most_likely():
    out = draw(rows(LOGITS, 500), temperature=5.0, top_k=2, seeds=range(500))
    assert set(out.token_ids.tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_set_holding_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logprobs = probs.log()[None]
    kept_07 = filter_top_k_top_p(logprobs, torch.tensor([0]), torch.tensor([0.7])).isfinite()[0].tolist()
    kept_09 = filter_top_k_top_p(logprobs, torch.tensor([0]), torch.tensor([0.9])).isfinite()[0].tolist()
    assert kept_07 == [True, True, False, False]
    assert kept_09 == [True, True, True, False]


def test_top_p_renormalizes_what_is_kept():
    logprobs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = filter_top_k_top_p(logprobs, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.allclose(kept.exp()[0, :2], torch.tensor([0.625, 0.375]))


def test_tiny_top_p_is_greedy():
    out = draw(rows(LOGITS, 50), top_p=1e-6, seeds=range(50))
    assert set(out.token_ids.tolist()) == {0}


def test_temperature_zero_is_greedy_with_logprobs_at_temperature_one():
    out = draw(rows([0.0, 3.0, 1.0]), temperature=0.0)
    assert out.token_ids.tolist() == [1]
    assert torch.allclose(out.logprobs[0], torch.log_softmax(torch.tensor([0.0, 3.0, 1.0]), dim=-1)[1])


def test_a_row_draws_the_same_whatever_shares_its_batch():
    def draws(logits: torch.Tensor, seeds: list[int], row: int) -> list[int]:
        count = logits.shape[0]
        rngs = generators(*seeds)  # kept across steps, as the engine keeps one per sequence
        params = (torch.full((count,), 3.0), torch.ones(count), torch.zeros(count, dtype=torch.long))
        return [sample(logits, *params, rngs).token_ids[row].item() for _ in range(20)]

    alone = draws(rows(LOGITS), [11], row=0)
    together = draws(torch.tensor([[0.0] * 5, LOGITS, [1.0] * 5]), [5, 11, 6], row=1)
    assert alone == together


def test_top_logprobs_are_the_most_likely_tokens_at_the_sampling_temperature():
    out = draw(rows(LOGITS), temperature=0.5, num_top=2)
    expected = torch.log_softmax(torch.tensor(LOGITS) / 0.5, dim=-1)
    assert out.top_ids[0].tolist() == [0, 1]
    assert torch.allclose(out.top_logprobs[0], expected[:2])


# ---- scheduler ----


def pending(n: int) -> PendingRequest:
    return PendingRequest(GenerationRequest(prompt_ids=[1], n=n), seeds=list(range(n)))


def test_scheduler_is_first_come_first_served_up_to_the_batch_size():
    scheduler = Scheduler(max_batch_size=3)
    a, b, c = pending(2), pending(2), pending(2)
    for request in (a, b, c):
        scheduler.add(request.sequences)
    first, second = scheduler.next_batch(), scheduler.next_batch()
    assert first == [*a.sequences, b.sequences[0]]
    assert second == [b.sequences[1], *c.sequences]
    assert scheduler.next_batch() == [] and scheduler.num_waiting == 0


def test_scheduler_skips_cancelled_requests():
    scheduler = Scheduler(max_batch_size=8)
    cancelled, kept = pending(2), pending(1)
    scheduler.add(cancelled.sequences)
    scheduler.add(kept.sequences)
    assert cancelled.future.cancel()
    assert scheduler.next_batch() == kept.sequences


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
