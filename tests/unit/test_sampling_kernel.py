"""The Triton sampler draws what torch's `sample` draws, from the same uniforms, with the same logprobs.

Runs on a GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`, set before pytest starts);
skipped without triton or without either.
"""

from __future__ import annotations

import pytest
import torch
from triton_device import device_or_skip

from asyncrl.inference.engine.sampling import SamplingBatch, sample, sample_fused
from asyncrl.inference.engine.sequence import GenerationRequest
from asyncrl.inference.kernels.sampling_kernel import BLOCK

DEVICE = device_or_skip()


def params(temperature: float) -> GenerationRequest:
    """Sampling parameters with only a temperature, as the engine passes its requests."""
    return GenerationRequest([0], temperature=temperature)


def random_logits(rows: int, vocab: int, dtype, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * scale).to(dtype).to(DEVICE)


def uniforms_for(rows: int, seed: int = 1) -> torch.Tensor:
    return torch.rand(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(DEVICE)


@pytest.mark.parametrize("vocab", [300, BLOCK, 3 * BLOCK + 77])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_same_tokens_and_logprobs_as_torch(vocab, dtype):
    temperatures = [1.0, 0.7, 0, 1.3, 0.2, 1.0, 0, 2.0] * 4
    batch = SamplingBatch.of([params(temperature=t) for t in temperatures], DEVICE)
    logits = random_logits(len(temperatures), vocab, dtype)
    uniforms = uniforms_for(len(temperatures))
    fused = sample_fused(logits, batch, uniforms)
    on_cpu = SamplingBatch.of([params(temperature=t) for t in temperatures], "cpu")
    expected = sample(logits.cpu(), on_cpu, uniforms.cpu())
    assert fused.token_ids.tolist() == expected.token_ids.tolist()
    assert torch.allclose(fused.logprobs.float().cpu(), expected.logprobs, atol=1e-5, rtol=0)
    # The host table carries the same values.
    table = fused.to_host().read()
    assert table[0] == expected.token_ids.tolist()
    assert torch.allclose(torch.tensor(table[1], dtype=torch.float64), expected.logprobs.double(), atol=1e-5, rtol=0)
    assert table[2] == [[]] * len(temperatures)


def test_draws_follow_the_distribution():
    """Uniforms on an even grid land on each token in proportion to its probability, across blocks."""
    vocab, draws = 2 * BLOCK + 5, 1024
    logits = torch.full((1, vocab), -30.0)
    chosen = torch.tensor([3, BLOCK - 1, BLOCK, 2 * BLOCK + 4])  # both sides of block edges, the last token
    logits[0, chosen] = torch.tensor([0.0, 1.0, -0.5, 0.5])
    probs = torch.softmax(logits[0].double() / 0.9, dim=0)
    batch = SamplingBatch.of([params(temperature=0.9)] * draws, DEVICE)
    grid = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    sampled = sample_fused(logits.expand(draws, vocab).contiguous().to(DEVICE), batch, grid.to(DEVICE))
    counts = torch.bincount(sampled.token_ids.cpu(), minlength=vocab).double() / draws
    assert set(sampled.token_ids.tolist()) <= set(chosen.tolist())
    assert torch.allclose(counts[chosen], probs[chosen], atol=2 / draws)


def test_greedy_takes_the_first_maximum():
    logits = torch.zeros(2, 2 * BLOCK)
    logits[:, [5, BLOCK + 7]] = 4.0  # a tie across blocks: the first wins, as with torch.argmax
    batch = SamplingBatch.of([params(temperature=0), params(temperature=0)], DEVICE)
    sampled = sample_fused(logits.to(DEVICE), batch, uniforms_for(2))
    assert sampled.token_ids.tolist() == [5, 5]
    expected = torch.log_softmax(logits[0], dim=0)[5].item()
    assert sampled.logprobs.tolist() == pytest.approx([expected, expected], abs=1e-6)


def test_cold_temperature_and_extreme_uniforms():
    """A draw at u close to 1 never picks a token without mass (the padded tail of the last block)."""
    vocab = BLOCK + 10
    logits = random_logits(3, vocab, torch.float32, seed=4)
    batch = SamplingBatch.of([params(temperature=t) for t in (0.05, 1.0, 1.0)], DEVICE)
    uniforms = torch.tensor([0.5, 1 - 1e-16, 0.0], dtype=torch.float64, device=DEVICE)
    sampled = sample_fused(logits, batch, uniforms)
    tokens = sampled.token_ids.tolist()
    assert tokens[0] == logits[0].argmax().item()  # at T = 0.05 one token holds nearly all the mass
    assert all(0 <= token < vocab for token in tokens)
    scaled = logits.cpu() / torch.tensor([0.05, 1.0, 1.0])[:, None]
    expected = torch.log_softmax(scaled, dim=-1).gather(-1, sampled.token_ids.cpu()[:, None])[:, 0]
    assert torch.allclose(sampled.logprobs.float().cpu(), expected, atol=1e-5)
