"""Chunked LM-head logprobs: the same values and gradients as full logits, with memory bounded by one chunk."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from asyncrl.trainer.logprobs import chunked_token_logprobs, token_logprobs


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of tensors that ops create and that are still alive, and their peak: a CPU
    stand-in for the CUDA allocator's peak statistics. Views and in-place results are not new memory."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest = 0
        self.seen: set[int] = set()

    def _release(self, key: int, size: int) -> None:
        self.seen.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor._base is not None:
                continue
            key, size = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
            if key in self.seen or size == 0:
                continue
            self.seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            self.largest = max(self.largest, size)
            weakref.finalize(tensor, self._release, key, size)
        return out


def make_inputs(tokens: int, vocab: int, hidden: int = 16, dtype=torch.float64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=generator, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=generator, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, vocab, (tokens,), generator=generator)
    temperature = 0.5 + torch.rand(tokens, generator=generator)
    upstream = torch.randn(tokens, generator=generator, dtype=torch.float32)
    return h, weight, ids, temperature, upstream


@pytest.mark.parametrize(
    ("chunk_size", "with_entropy", "compiled"),
    [(1, True, False), (7, True, False), (64, True, False), (1000, True, False), (16, False, False), (16, True, True)],
    ids=["chunk1", "chunk7", "chunk64", "chunk1000", "sft-no-entropy", "compiled"],
)
def test_chunked_logprobs_and_gradients_equal_the_full_logits_computation(chunk_size, with_entropy, compiled):
    """Also SFT's path (no entropy: zeros) and `perf.compile`'s (the softmax math through torch.compile)."""
    h, weight, ids, temperature, upstream = make_inputs(tokens=64, vocab=50)
    expected, expected_entropy = token_logprobs(h @ weight.T, ids, temperature)
    (expected * upstream).sum().backward()
    expected_grads = h.grad.clone(), weight.grad.clone()
    h.grad = weight.grad = None

    logprobs, entropy = chunked_token_logprobs(h, weight, ids, temperature, chunk_size, with_entropy, compiled)
    (logprobs * upstream).sum().backward()

    # Both take the logits in float32: equal to float32 rounding (compiled kernels may sum in another order).
    tolerance = 1e-5 if compiled else 1e-6
    torch.testing.assert_close(logprobs, expected, rtol=1e-6, atol=1e-6)
    if with_entropy:
        torch.testing.assert_close(entropy, expected_entropy, rtol=tolerance, atol=tolerance)
    else:
        assert not entropy.any()
    assert logprobs[0] == 0 and entropy[0] == 0
    torch.testing.assert_close(h.grad, expected_grads[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, expected_grads[1], rtol=1e-5, atol=1e-5)


def test_a_scalar_temperature_equals_the_same_temperature_per_token():
    h, weight, ids, _, _ = make_inputs(tokens=20, vocab=30)
    scalar, _ = chunked_token_logprobs(h, weight, ids, 0.7, chunk_size=8)
    per_token, _ = chunked_token_logprobs(h, weight, ids, torch.full((20,), 0.7), chunk_size=8)
    torch.testing.assert_close(scalar, per_token)


def test_entropy_carries_no_gradient():
    h, weight, ids, temperature, _ = make_inputs(tokens=8, vocab=10)
    _, entropy = chunked_token_logprobs(h, weight, ids, temperature, chunk_size=3)
    assert not entropy.requires_grad


def peak_of_a_step(tokens: int, vocab: int, chunk_size: int | None) -> LiveTensorBytes:
    h, weight, ids, temperature, upstream = make_inputs(tokens, vocab, hidden=32, dtype=torch.float32)
    with LiveTensorBytes() as memory:
        if chunk_size is None:
            logprobs, _ = token_logprobs(h @ weight.T, ids, temperature)
        else:
            logprobs, _ = chunked_token_logprobs(h, weight, ids, temperature, chunk_size)
        (logprobs * upstream).sum().backward()
    return memory


def test_peak_memory_is_bounded_by_one_chunk_of_logits_as_vocab_and_sequence_grow():
    chunk = 64
    small, large = peak_of_a_step(512, 1024, chunk), peak_of_a_step(1024, 2048, chunk)
    full = peak_of_a_step(1024, 2048, None)
    one_chunk = chunk * 2048 * 4  # float32 logits of one chunk
    assert large.largest <= one_chunk < 1024 * 2048 * 4 <= full.largest
    # Full logits grow with tokens x vocab (4x here); the chunked peak only with tokens + vocab (2x).
    assert large.peak < 2.5 * small.peak
    assert large.peak < full.peak / 8
