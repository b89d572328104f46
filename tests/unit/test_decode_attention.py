"""Split-KV decoding attention equals plain attention over each row's own keys, whatever the splits.

Runs on a GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`, read when the kernels are
defined, so set it before pytest starts); skipped without triton or without either. The interpreter's
tl.dot is wrong in bfloat16 (numpy has no bfloat16), so there bfloat16 is skipped and float16 / float32
stand in for it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_device import INTERPRETED, device_or_skip

from asyncrl.inference.kernels.decode_attention import decode_attention

DEVICE = device_or_skip()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def skip_unsupported(dtype: torch.dtype) -> None:
    if INTERPRETED and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter multiplies bfloat16 matrices wrongly")


def tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return 1e-2 if not INTERPRETED else 1e-5  # on the GPU tl.dot takes float32 as tf32
    return 2e-2


def make_cache(slots: int, max_len: int, kv_heads: int, dim: int, dtype, seed: int = 0):
    """Keys and values as the engine holds them: strided views of one [layer, slot, position, kv, dim]
    tensor per kind, here of layer 1 of 2."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, slots, max_len, kv_heads, dim)
    keys = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
    values = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
    return keys[1], values[1]


def make_queries(batch: int, heads: int, dim: int, dtype, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, dim, generator=generator).to(dtype).to(DEVICE)


def reference(q, keys, values, used) -> torch.Tensor:
    """Float32 scaled-dot-product attention of each row over its first used[i] keys."""
    group = q.shape[1] // keys.shape[2]
    rows = []
    for i, length in enumerate(used.tolist()):
        k = keys[i, :length].float().transpose(0, 1).repeat_interleave(group, dim=0)
        v = values[i, :length].float().transpose(0, 1).repeat_interleave(group, dim=0)
        rows.append(F.scaled_dot_product_attention(q[i].float()[:, None], k, v)[:, 0])
    return torch.stack(rows)


def lengths(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def assert_close(actual, expected, dtype) -> None:
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected, atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads,group,dim", [(2, 2, 64), (2, 1, 128), (1, 4, 16), (2, 8, 32)])
def test_matches_attention_over_each_rows_keys(kv_heads, group, dim, dtype):
    """Fewer rows than slots; lengths of 1, of the whole context and in between; several splits (one per
    32-key block here), of which the short rows leave some empty."""
    skip_unsupported(dtype)
    context = 100
    keys, values = make_cache(slots=5, max_len=128, kv_heads=kv_heads, dim=dim, dtype=dtype)
    q = make_queries(3, kv_heads * group, dim, dtype)
    used = lengths([1, context, 37])
    out = decode_attention(q, keys, values, used, context, block_n=32)
    assert_close(out, reference(q, keys, values, used), dtype)


@pytest.mark.parametrize("split_size", [16, 48, 112, 128])
def test_split_size_does_not_change_the_result(split_size):
    """From one split per block to one split for the whole context (the output written without the merge)."""
    context = 112
    keys, values = make_cache(slots=3, max_len=128, kv_heads=2, dim=32, dtype=torch.float16)
    q = make_queries(3, 4, 32, torch.float16)
    used = lengths([112, 5, 64])
    out = decode_attention(q, keys, values, used, context, block_n=16, split_size=split_size)
    assert_close(out, reference(q, keys, values, used), torch.float16)


def test_keys_past_a_rows_length_are_never_read():
    """NaN after each row's length (and in the slots past the batch) stays out of the output."""
    keys, values = make_cache(slots=3, max_len=64, kv_heads=2, dim=16, dtype=torch.float32)
    used = lengths([3, 64])
    for i, length in enumerate(used.tolist()):
        keys[i, length:] = float("nan")
        values[i, length:] = float("nan")
    keys[2:], values[2:] = float("nan"), float("nan")
    q = make_queries(2, 4, 16, torch.float32)
    out = decode_attention(q, keys, values, used, context=64, block_n=16)
    assert out.isfinite().all()
    assert_close(out, reference(q, keys, values, used), torch.float32)


def test_reads_strided_queries_and_interleaved_cache():
    """q as a slice of a fused q/k/v projection; keys and values interleaved in one cache tensor."""
    batch, kv_heads, group, dim = 2, 2, 2, 32
    generator = torch.Generator().manual_seed(2)
    qkv = torch.randn(batch, kv_heads * (group + 2), dim, generator=generator).to(DEVICE)
    q = qkv[:, : kv_heads * group]
    cache = torch.randn(4, 80, 2, kv_heads, dim, generator=generator).to(DEVICE)
    keys, values = cache[:, :, 0], cache[:, :, 1]
    used = lengths([80, 41])
    out = torch.full((batch, kv_heads * group, dim), float("nan"), device=DEVICE)
    result = decode_attention(q, keys, values, used, context=80, out=out, block_n=16)
    assert result is out
    assert_close(out, reference(q, keys, values, used), torch.float32)


@pytest.mark.skipif(INTERPRETED, reason="CUDA graphs need a GPU")
def test_a_captured_graph_replays_for_new_lengths():
    """The grid depends on `context` alone, so one capture serves any lengths up to it."""
    dtype, context = torch.bfloat16, 256
    keys, values = make_cache(slots=4, max_len=256, kv_heads=8, dim=128, dtype=dtype)
    q = make_queries(4, 16, 128, dtype)
    used = lengths([1, 2, 3, 4])
    decode_attention(q, keys, values, used, context)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, keys, values, used, context)
    used.copy_(lengths([256, 1, 130, 77]))
    graph.replay()
    assert_close(out, reference(q, keys, values, used), dtype)


@pytest.mark.parametrize("split_size", [16, 64])
def test_rows_that_share_a_prompt_read_it_from_its_slot_exactly_as_their_own_copy(split_size):
    """Rows 1 and 2 share the 37-token prompt held by slot 0 (their own slots hold NaN there: never read);
    row 3 reads its own slot only (prefix length 0). The output is bit for bit that of a cache where every
    row holds its own copy of the prompt, prompt boundaries inside and on the edges of key blocks."""
    dtype, prompt = torch.float16, 37
    keys, values = make_cache(slots=4, max_len=64, kv_heads=2, dim=32, dtype=dtype)
    for slot in (1, 2):  # the copies the shared layout does without
        keys[slot, :prompt], values[slot, :prompt] = keys[0, :prompt], values[0, :prompt]
    q = make_queries(4, 4, 32, dtype)
    used = lengths([40, 64, prompt + 1, 50])
    copied = decode_attention(q, keys, values, used, context=64, block_n=16, split_size=split_size)
    for slot in (1, 2):
        keys[slot, :prompt], values[slot, :prompt] = float("nan"), float("nan")
    shared = decode_attention(
        q, keys, values, used, context=64, block_n=16, split_size=split_size,
        prefix_slots=lengths([0, 0, 0, 3]), prefix_lens=lengths([prompt, prompt, prompt, 0]),
    )  # fmt: skip
    assert torch.equal(shared, copied)
    keys[1:3, :prompt], values[1:3, :prompt] = keys[0, :prompt], values[0, :prompt]
    assert_close(shared, reference(q, keys, values, used), dtype)


def test_prefix_slots_and_lengths_come_together():
    keys, values = make_cache(slots=1, max_len=16, kv_heads=1, dim=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="together"):
        decode_attention(
            make_queries(1, 1, 16, torch.float32), keys, values, lengths([4]), 16, prefix_slots=lengths([0])
        )
