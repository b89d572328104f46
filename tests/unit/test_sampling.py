"""The sampler, without a model."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from asyncrl.inference.sampling import SamplingBatch, filter_logprobs, inverse_cdf, sample


@dataclass
class Params:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    top_logprobs: int = 0


def uniforms(*seeds: int) -> torch.Tensor:
    return torch.tensor([random.Random(seed).random() for seed in seeds], dtype=torch.float64)


def rows(values: list[float], count: int = 1) -> torch.Tensor:
    return torch.tensor([values] * count)


def draw(logits: torch.Tensor, seeds=(0,), **params):
    batch = SamplingBatch.of([Params(**params)] * logits.shape[0], "cpu")
    return sample(logits, batch, uniforms(*seeds))


def keep(probs: list[float], top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> list[bool]:
    logprobs = torch.tensor([probs]).log()
    kept = filter_logprobs(logprobs, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
    return kept.isfinite()[0].tolist()


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


def test_the_two_level_inverse_cdf_draws_what_one_scan_over_the_vocabulary_draws():
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 5000, generator=generator) * 3, dim=-1)
    probs[:, 1000:2048] = 0  # whole blocks of zero mass are stepped over
    u = torch.rand(64, generator=generator, dtype=torch.float64)
    cumulative = probs.cumsum(-1, dtype=torch.float64)
    expected = torch.searchsorted(cumulative, u[:, None] * cumulative[:, -1:], right=True)[:, 0]
    assert inverse_cdf(probs, u).tolist() == expected.tolist()
    edges = inverse_cdf(probs[:2], torch.tensor([0.0, 1.0 - 1e-12], dtype=torch.float64)).tolist()
    assert edges[0] == int(probs[0].nonzero()[0]) and edges[1] == int(probs[1].nonzero()[-1])


def test_a_token_of_zero_probability_is_never_drawn():
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0, float("-inf")]] * 200)
    assert set(draw(logits, seeds=range(200)).token_ids.tolist()) == {1, 3}


def test_top_k_limits_draws_to_the_k_most_likely():
    out = draw(rows(LOGITS, 500), temperature=5.0, top_k=2, seeds=range(500))
    assert set(out.token_ids.tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_set_holding_p():
    assert keep([0.5, 0.3, 0.15, 0.05], top_p=0.7) == [True, True, False, False]
    assert keep([0.5, 0.3, 0.15, 0.05], top_p=0.9) == [True, True, True, False]


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely():
    assert keep([0.5, 0.3, 0.15, 0.05], min_p=0.3) == [True, True, True, False]
    assert keep([0.5, 0.3, 0.15, 0.05], min_p=0.7) == [True, False, False, False]


def test_filters_renormalize_what_is_kept():
    logprobs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = filter_logprobs(logprobs, torch.tensor([0]), torch.tensor([0.7]), torch.tensor([0.0]))
    assert torch.allclose(kept.exp()[0, :2], torch.tensor([0.625, 0.375]))


def test_a_row_without_limits_is_not_filtered_by_its_neighbours_limits():
    batch = SamplingBatch.of([Params(), Params(top_k=1)], "cpu")
    logprobs = torch.log_softmax(rows(LOGITS, 2), -1)
    filtered = filter_logprobs(logprobs, batch.top_k, batch.top_p, batch.min_p)
    assert batch.any_filtered
    assert torch.equal(filtered[0], logprobs[0]) and filtered[1].isfinite().sum() == 1


def test_tiny_top_p_is_greedy():
    out = draw(rows(LOGITS, 50), top_p=1e-6, seeds=range(50))
    assert set(out.token_ids.tolist()) == {0}


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    out = draw(rows([0.0, 3.0, 1.0], 8), top_p=1e-46, seeds=range(8))
    assert out.token_ids.tolist() == [1] * 8 and out.logprobs.isfinite().all()


def test_a_temperature_too_small_to_divide_by_is_greedy_with_logprobs_at_temperature_one():
    for temperature in (1e-38, 1e-46, 1e-6):
        out = draw(rows([0.0, 3.0, 1.0]), temperature=temperature)
        assert out.token_ids.tolist() == [1]
        assert torch.allclose(out.logprobs[0], torch.log_softmax(torch.tensor([0.0, 3.0, 1.0]), dim=-1)[1])


def test_temperature_zero_is_greedy_with_logprobs_at_temperature_one():
    out = draw(rows([0.0, 3.0, 1.0]), temperature=0.0)
    assert out.token_ids.tolist() == [1]
    assert torch.allclose(out.logprobs[0], torch.log_softmax(torch.tensor([0.0, 3.0, 1.0]), dim=-1)[1])


def test_a_row_draws_the_same_whatever_shares_its_batch():
    def draws(logits: torch.Tensor, seeds: list[int], row: int) -> list[int]:
        rngs = [random.Random(seed) for seed in seeds]  # kept across steps, as the engine keeps one per sample
        batch = SamplingBatch.of([Params(temperature=3.0)] * len(seeds), "cpu")
        steps = []
        for _ in range(20):
            draws = torch.tensor([rng.random() for rng in rngs], dtype=torch.float64)
            steps.append(sample(logits, batch, draws).token_ids[row].item())
        return steps

    alone = draws(rows(LOGITS), [11], row=0)
    together = draws(torch.tensor([[0.0] * 5, LOGITS, [1.0] * 5]), [5, 11, 6], row=1)
    assert alone == together


def test_top_logprobs_are_the_most_likely_tokens_at_the_sampling_temperature():
    out = draw(rows(LOGITS), temperature=0.5, top_logprobs=2)
    expected = torch.log_softmax(torch.tensor(LOGITS) / 0.5, dim=-1)
    assert out.top_ids[0].tolist() == [0, 1]
    assert torch.allclose(out.top_logprobs[0], expected[:2])
