"""The one-kernel heads of a decoding step equal `split_heads` followed by the indexed cache writes.

Runs on a GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`, read when the kernels are
defined, so set it before pytest starts); skipped without triton or without either. bfloat16 is skipped
under the interpreter: numpy has no bfloat16, and the interpreter casts float32 to it by truncation, not
rounding to nearest as torch and the GPU do; float16 exercises the same rounding steps there.
"""

from __future__ import annotations

import pytest
import torch
from triton_device import INTERPRETED, device_or_skip

from asyncrl.inference.engine.model_runner import rotary_tables as runner_tables
from asyncrl.inference.engine.model_runner import split_heads
from asyncrl.inference.kernels.decode_heads import decode_heads

DEVICE = device_or_skip()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


def skip_unsupported(dtype: torch.dtype) -> None:
    if INTERPRETED and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter truncates float32 to bfloat16 instead of rounding it")


def tolerance(dtype: torch.dtype) -> dict:
    """float32: rounding only. Half precision: both round each step to the dtype alike, but the norm's sum
    (another order) and rsqrt may differ in float32's last bits, which can flip one rounding to the dtype;
    through the weight and the rotary products and sum that is a couple of ulps of values up to ~4."""
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    ulp = torch.finfo(dtype).eps
    return {"atol": 8 * ulp, "rtol": 2 * ulp}


def rotary_tables(max_len: int, dim: int, dtype):
    """cos and sign-folded sin as the runner builds them ([max_len, dim], halves equal)."""
    inverse = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.arange(max_len).float()[:, None] * inverse[None]
    angles = torch.cat((angles, angles), dim=-1)
    half = dim // 2
    sin = angles.sin()
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return angles.cos().to(dtype).to(DEVICE), sin.to(dtype).to(DEVICE)


def make_inputs(batch, heads, kv_heads, dim, dtype, norm: bool, slots=6, max_len=40, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def random(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)

    qkv = random(batch, (heads + 2 * kv_heads) * dim)
    scale = 1 + 0.5 * torch.randn(heads + kv_heads, dim, generator=generator)  # norm weights near 1
    qk_scale = scale.to(dtype).to(DEVICE) if norm else None
    cos, sin = rotary_tables(max_len, dim, dtype)
    # Layer 1 of a 2-layer cache: strided views, as the runner passes them.
    keys, values = random(2, slots, max_len, kv_heads, dim), random(2, slots, max_len, kv_heads, dim)
    positions = torch.randperm(max_len, generator=generator)[:batch].to(DEVICE)  # a different one per row
    return qkv, qk_scale, cos, sin, positions, keys, values


def reference(qkv, qk_scale, cos, sin, positions, keys, values, heads, rotary_dim=None):
    """The runner's other paths: `split_heads` (eager) with the position gathers, then the index writes."""
    dim = keys.shape[-1]
    tables = cos[positions][:, None], sin[positions][:, None]
    q, k, v = split_heads(qkv, qk_scale, EPS, *tables, heads, dim, rotary_dim or dim)
    rows = torch.arange(qkv.shape[0], device=qkv.device)
    keys[rows, positions] = k
    values[rows, positions] = v
    return q


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("batch,heads,kv_heads,dim", [(1, 4, 2, 64), (5, 8, 2, 32), (3, 2, 1, 128)])
def test_matches_split_heads_and_the_cache_writes(batch, heads, kv_heads, dim, norm, dtype):
    """Each row at its own position; k and v land in layer 1 of the cache, nothing else changes there."""
    skip_unsupported(dtype)
    qkv, qk_scale, cos, sin, positions, keys, values = make_inputs(batch, heads, kv_heads, dim, dtype, norm)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected = reference(qkv, qk_scale, cos, sin, positions, expected_keys[1], expected_values[1], heads)
    q = decode_heads(qkv, qk_scale, EPS, cos, sin, positions, keys[1], values[1], heads)
    assert q.shape == (batch, heads, dim) and q.dtype == dtype and q.is_contiguous()
    torch.testing.assert_close(q, expected, **tolerance(dtype))
    torch.testing.assert_close(keys, expected_keys, **tolerance(dtype))
    # v is copied: exact, and every other entry of both caches is untouched.
    assert torch.equal(values, expected_values)
    written = torch.zeros(keys.shape[:3], dtype=torch.bool, device=DEVICE)
    written[1, torch.arange(batch, device=DEVICE), positions] = True
    assert torch.equal(keys[~written], expected_keys[~written])


def test_int32_positions_and_a_strided_projection():
    """qkv as a slice of wider rows, positions as int32: the same result."""
    batch, heads, kv_heads, dim, dtype = 4, 4, 2, 32, torch.float16
    qkv, qk_scale, cos, sin, positions, keys, values = make_inputs(batch, heads, kv_heads, dim, dtype, norm=True)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected = reference(qkv, qk_scale, cos, sin, positions, expected_keys[1], expected_values[1], heads)
    wide = torch.zeros(batch, qkv.shape[1] + 16, dtype=dtype, device=DEVICE)
    wide[:, : qkv.shape[1]] = qkv
    q = decode_heads(wide[:, : qkv.shape[1]], qk_scale, EPS, cos, sin, positions.int(), keys[1], values[1], heads)
    torch.testing.assert_close(q, expected, **tolerance(dtype))
    torch.testing.assert_close(keys, expected_keys, **tolerance(dtype))
    assert torch.equal(values, expected_values)


def test_shapes_that_do_not_fit_are_refused():
    qkv, qk_scale, cos, sin, positions, keys, values = make_inputs(2, 4, 2, 32, torch.float32, norm=True)
    with pytest.raises(ValueError, match="is not 3 q \\+ 2 k \\+ 2 v heads"):
        decode_heads(qkv, qk_scale, EPS, cos, sin, positions, keys[1], values[1], heads=3)
    with pytest.raises(ValueError, match="qk_scale"):
        decode_heads(qkv, qk_scale[1:], EPS, cos, sin, positions, keys[1], values[1], heads=4)
    with pytest.raises(ValueError, match="same dtype"):
        decode_heads(qkv, qk_scale, EPS, cos.half(), sin.half(), positions, keys[1], values[1], heads=4)
    with pytest.raises(ValueError, match="do not fit 2 rows"):
        decode_heads(qkv, qk_scale, EPS, cos, sin, positions, keys[1, :1], values[1, :1], heads=4)


@pytest.mark.skipif(INTERPRETED, reason="CUDA graphs need a GPU")
def test_a_captured_graph_replays_for_new_positions():
    batch, heads, kv_heads, dim, dtype = 4, 16, 8, 128, torch.bfloat16
    qkv, qk_scale, cos, sin, positions, keys, values = make_inputs(batch, heads, kv_heads, dim, dtype, norm=True)
    decode_heads(qkv, qk_scale, EPS, cos, sin, positions, keys[1], values[1], heads)  # compiles outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = decode_heads(qkv, qk_scale, EPS, cos, sin, positions, keys[1], values[1], heads)
    positions.copy_(torch.tensor([39, 0, 7, 20], device=DEVICE))
    expected_keys, expected_values = keys.clone(), values.clone()
    expected = reference(qkv, qk_scale, cos, sin, positions, expected_keys[1], expected_values[1], heads)
    graph.replay()
    torch.testing.assert_close(q, expected, **tolerance(dtype))
    torch.testing.assert_close(keys, expected_keys, **tolerance(dtype))
    assert torch.equal(values, expected_values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_partial_rotary_turns_the_first_dimensions_only(dtype):
    """GLM-style rotary on half of each head: the runner's tables (cos 1, sin 0 past the rotated half) and the
    kernel's partners agree with split_heads, and the other half passes through unrotated."""
    batch, heads, kv_heads, dim = 3, 4, 2, 64
    qkv, qk_scale, _, _, positions, keys, values = make_inputs(batch, heads, kv_heads, dim, dtype, norm=False)
    rotary = dim // 2  # transformers' raw tables for those dimensions, halves equal
    inverse = 1.0 / 10000 ** (torch.arange(0, rotary, 2).float() / rotary)
    angles = torch.arange(40).float()[:, None] * inverse[None]
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = (t.to(dtype).to(DEVICE) for t in runner_tables(angles.cos(), angles.sin(), dim))
    expected_keys, expected_values = keys.clone(), values.clone()
    expected = reference(qkv, None, cos, sin, positions, expected_keys[1], expected_values[1], heads, dim // 2)
    q = decode_heads(qkv, None, EPS, cos, sin, positions, keys[1], values[1], heads, rotary_dim=dim // 2)
    torch.testing.assert_close(q, expected, **tolerance(dtype))
    torch.testing.assert_close(keys, expected_keys, **tolerance(dtype))
    passed = qkv.view(batch, -1, dim)[:, :heads, dim // 2 :]
    assert torch.equal(q[..., dim // 2 :], passed)
