"""The sampler, without a model."""

from __future__ import annotations

import random

import pytest
import torch

from asyncrl.inference.engine.sampling import LogitAdjustments, SamplingBatch, filter_logprobs, inverse_cdf, sample
from asyncrl.inference.engine.sequence import GenerationRequest


def Params(prompt_ids: list[int] = [0], **fields) -> GenerationRequest:  # noqa: B006, N802 - read-only default
    """A request's sampling fields, as the engine passes them to the sampler."""
    return GenerationRequest(prompt_ids, **fields)


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


# ---- logit_bias and penalties ----


def adjusted(logits: list[float], outputs: list[int], prompt: list[int] = [0], **fields) -> list[float]:  # noqa: B006
    adjustments = LogitAdjustments.of([Params(prompt, **fields)], [outputs], "cpu")
    return adjustments.apply(torch.tensor([logits])).tolist()[0]


def test_logit_bias_is_added_to_the_logits_of_its_tokens():
    assert adjusted([2.0, 1.0, 0.5], [], logit_bias={1: 1.5, 2: -100.0}) == [2.0, 2.5, -99.5]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output_tokens():
    # Token 0 is in the prompt, 2 and 3 in the output, 1 and 4 in neither.
    logits = [2.0, 3.0, 0.5, -1.0, -2.0]
    assert adjusted(logits, [2, 3, 3], prompt=[0], repetition_penalty=2.0) == [1.0, 3.0, 0.25, -2.0, -2.0]


def test_frequency_penalty_counts_output_tokens_and_presence_penalty_does_not():
    logits = [2.0, 1.0, 0.5, 0.0]
    # Token 0 is in the prompt only: neither penalty touches it. Token 2 was generated twice, 3 once.
    assert adjusted(logits, [2, 2, 3], prompt=[0], frequency_penalty=0.25) == [2.0, 1.0, 0.0, -0.25]
    assert adjusted(logits, [2, 2, 3], prompt=[0], presence_penalty=0.5) == [2.0, 1.0, 0.0, -0.5]
    assert adjusted(logits, [2, 2, 3], prompt=[0], presence_penalty=-0.5) == [2.0, 1.0, 1.0, 0.5]


def test_bias_then_repetition_then_frequency_then_presence():
    # vLLM's order. Token 4: 3.0 + 1.0 biased = 4.0; / 2 repeated = 2.0; - 2 x 0.25 = 1.5; - 0.5 = 1.0.
    # Token 2 (no bias): 0.5 / 2 = 0.25; - 0.5 = -0.25; - 0.5 = -0.75. Token 0 is in the prompt: 2.0 / 2.
    fields = {"logit_bias": {4: 1.0}, "repetition_penalty": 2.0, "frequency_penalty": 0.25, "presence_penalty": 0.5}
    assert adjusted([2.0, -1.0, 0.5, 0.0, 3.0], [2, 2, 4, 4], prompt=[0], **fields) == [
        1.0,
        -1.0,
        -0.75,
        0.0,
        1.0,
    ]


def test_rows_without_adjustments_keep_their_logits_and_a_batch_without_any_has_none():
    logits = torch.tensor([[2.0, 1.0, 0.5], [0.3, 0.2, 0.1]])
    both = LogitAdjustments.of([Params(), Params(frequency_penalty=1.0)], [[0], [0]], "cpu")
    assert both.apply(logits).tolist() == [
        [2.0, 1.0, 0.5],
        [pytest.approx(-0.7), pytest.approx(0.2), pytest.approx(0.1)],
    ]
    assert LogitAdjustments.of([Params(), Params(top_k=2)], [[0], [0]], "cpu") is None


def test_the_sampler_counts_the_tokens_it_draws_for_the_next_step():
    # Greedy with a frequency penalty of 1: token 0 leads by 0.1, is drawn, then loses 1 and token 1 leads.
    batch = SamplingBatch.of([Params(temperature=0.0, frequency_penalty=1.0)], "cpu")
    logits = rows([1.0, 0.9, 0.05])
    assert sample(logits, batch, uniforms(0)).token_ids.tolist() == [0]
    assert sample(logits, batch, uniforms(0)).token_ids.tolist() == [1]
    assert sample(logits, batch, uniforms(0)).token_ids.tolist() == [2]  # 0.05 beats 1 - 1 and 0.9 - 1


def test_logprobs_are_of_the_adjusted_logits_at_the_temperature():
    batch = SamplingBatch.of([Params(temperature=0.5, logit_bias={3: 4.0}, top_logprobs=2)], "cpu")
    out = sample(rows(LOGITS), batch, uniforms(0))
    expected = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5, 3.0, -3.0]) / 0.5, dim=-1)
    assert torch.allclose(out.logprobs[0], expected[out.token_ids[0]])
    assert out.top_ids.tolist() == [[3, 0]]
    assert torch.allclose(out.top_logprobs[0], expected[[3, 0]])


def test_a_logit_bias_steers_greedy_and_sampled_draws():
    for temperature in (0.0, 1.0):
        batch = SamplingBatch.of([Params(temperature=temperature, logit_bias={4: 100.0})] * 8, "cpu")
        assert sample(rows(LOGITS, 8), batch, uniforms(*range(8))).token_ids.tolist() == [4] * 8
