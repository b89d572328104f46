"""The Triton experts (`fused_experts`) equal a float32 loop over the experts and the grouped-matmul reference.

Runs on a GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`, read when the kernels are
defined, so set it before pytest starts); skipped without triton or without either. The interpreter's
tl.dot is wrong in bfloat16 (numpy has no bfloat16), so there bfloat16 is skipped and float16 / float32
stand in for it. Shapes are small (H=64, I=32) so that the interpreter takes seconds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_device import INTERPRETED, device_or_skip

from asyncrl.inference.kernels.moe_experts import MAX_PAIRS_CHUNK, align_pairs, fused_experts, padded_rows
from asyncrl.models.moe import Experts, Routing, expert_counts

DEVICE = device_or_skip()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HIDDEN, INTERMEDIATE = 64, 32
# Small tiles, so that the small shapes still take several column tiles and reduction steps.
SMALL_BLOCKS = dict(gate_up_block_n=16, gate_up_block_k=32, down_block_n=32, down_block_k=16)


def skip_unsupported(dtype: torch.dtype) -> None:
    if INTERPRETED and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter multiplies bfloat16 matrices wrongly")


def tolerance(dtype: torch.dtype) -> float:
    """Outputs are O(1). bfloat16 / float16: a few roundings of 2^-8 / 2^-11 each (the reference's own error
    against float32 is of that size); float32 goes through tl.dot as tf32 on the GPU."""
    if dtype == torch.float32:
        return 1e-2 if not INTERPRETED else 1e-5
    return 3e-2 if dtype == torch.bfloat16 else 4e-3


def make_experts(experts: int, dtype, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE, seed: int = 0):
    """gate_up [E, 2I, H] and down [E, H, I], scaled so that every stage's values are O(1)."""
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * intermediate, hidden, generator=generator) / hidden**0.5
    down = torch.randn(experts, hidden, intermediate, generator=generator) / intermediate**0.5
    return gate_up.to(dtype).to(DEVICE), down.to(dtype).to(DEVICE)


def make_tokens(tokens: int, dtype, hidden: int = HIDDEN, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def uniform_routing(tokens: int, top_k: int, experts: int, seed: int = 2):
    """k distinct experts per token, uniformly at random; weights a softmax over them (float32)."""
    generator = torch.Generator().manual_seed(seed)
    indices = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1)
    return indices.to(DEVICE), weights.to(DEVICE)


def crowded_routing(tokens: int, experts: int, seed: int = 3):
    """k = 2: every token to expert 3 and to 5 or 11 (so those three get many blocks' worth), the other
    experts nothing."""
    generator = torch.Generator().manual_seed(seed)
    second = torch.where(torch.rand(tokens, generator=generator) < 0.5, 5, 11)
    indices = torch.stack([torch.full((tokens,), 3), second], dim=1) % experts
    weights = torch.softmax(torch.randn(tokens, 2, generator=generator), dim=-1)
    return indices.to(DEVICE), weights.to(DEVICE)


def loop_reference(x, indices, weights, gate_up, down) -> torch.Tensor:
    """Float32, one expert at a time: the weighted sum of each token's experts' SwiGLU outputs."""
    intermediate = down.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        tokens, slots = (indices == expert).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        rows = x[tokens].float()
        gate, up = gate_up[expert, :intermediate].float(), gate_up[expert, intermediate:].float()
        hidden = F.silu(rows @ gate.T) * (rows @ up.T)
        y = (hidden @ down[expert].float().T) * weights[tokens, slots, None].float()
        out.index_add_(0, tokens, y)
    return out


def grouped_mm_reference(x, indices, weights, gate_up, down) -> torch.Tensor:
    """The training path: `Experts.forward` (sorted pairs through `F.grouped_mm`, in x's dtype)."""
    experts = Experts(gate_up.shape[0], gate_up.shape[2], down.shape[2]).to(x.device)
    experts.gate_up_proj.data, experts.down_proj.data = gate_up, down
    with torch.no_grad():
        return experts(x, Routing(indices, weights, None), expert_counts(indices, gate_up.shape[0]))


def assert_close(actual, expected, dtype) -> None:
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance(dtype), rtol=tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "tokens,top_k,experts", [(1, 1, 8), (1, 8, 16), (7, 1, 16), (7, 2, 8), (7, 8, 16), (64, 2, 16), (64, 8, 8)]
)
def test_matches_a_loop_over_the_experts(tokens, top_k, experts, dtype):
    """Uniform routing: from one pair (one expert used, the others empty) to every expert in several blocks."""
    skip_unsupported(dtype)
    gate_up, down = make_experts(experts, dtype)
    x = make_tokens(tokens, dtype)
    indices, weights = uniform_routing(tokens, top_k, experts)
    out = fused_experts(x, indices, weights, gate_up, down, **SMALL_BLOCKS)
    assert out.shape == x.shape
    assert_close(out, loop_reference(x, indices, weights, gate_up, down), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("router_dtype", ["float32", "x"])
@pytest.mark.parametrize("tokens,top_k,experts", [(7, 2, 8), (64, 8, 16)])
def test_matches_the_grouped_mm_path_with_float32_or_low_precision_router_weights(
    tokens, top_k, experts, dtype, router_dtype
):
    """Against `Experts.forward` (router weights promoted as it promotes them): the two round alike, so they
    are closer to each other than either is to float32."""
    skip_unsupported(dtype)
    gate_up, down = make_experts(experts, dtype)
    x = make_tokens(tokens, dtype)
    indices, weights = uniform_routing(tokens, top_k, experts)
    if router_dtype == "x":
        weights = weights.to(dtype)
    out = fused_experts(x, indices, weights, gate_up, down, **SMALL_BLOCKS)
    reference = grouped_mm_reference(x, indices, weights, gate_up, down)
    assert_close(out, reference, dtype)
    exact = loop_reference(x, indices, weights, gate_up, down)
    ours, theirs = (out.float() - exact).abs().max(), (reference.float() - exact).abs().max()
    assert ours <= 2 * theirs + tolerance(dtype) / 10, (ours, theirs)


@pytest.mark.parametrize("block_m", [16, 32])
def test_experts_without_tokens_and_experts_with_many_blocks(block_m):
    """Two thirds of the experts get nothing; expert 3 gets every token (more than two blocks' worth)."""
    dtype, experts, tokens = torch.float16, 16, 70
    gate_up, down = make_experts(experts, dtype)
    x = make_tokens(tokens, dtype)
    indices, weights = crowded_routing(tokens, experts)
    out = fused_experts(x, indices, weights, gate_up, down, block_m=block_m, **SMALL_BLOCKS)
    assert_close(out, loop_reference(x, indices, weights, gate_up, down), dtype)


@pytest.mark.parametrize(
    "blocks",
    [
        {},  # the defaults (tiles larger than these small matrices: every load masked)
        dict(block_m=64, gate_up_block_n=32, gate_up_block_k=64, down_block_n=64, down_block_k=32),
        dict(block_m=16, gate_up_block_n=16, gate_up_block_k=16, down_block_n=16, down_block_k=16, num_stages=2),
    ],
    ids=["defaults", "large", "smallest"],
)
def test_block_sizes_do_not_change_the_result(blocks):
    dtype, experts, tokens, top_k = torch.float16, 8, 20, 2
    gate_up, down = make_experts(experts, dtype)
    x = make_tokens(tokens, dtype)
    indices, weights = uniform_routing(tokens, top_k, experts)
    out = fused_experts(x, indices, weights, gate_up, down, **blocks)
    assert_close(out, loop_reference(x, indices, weights, gate_up, down), dtype)


def test_sizes_that_are_no_multiple_of_the_tiles():
    """H = 80 and I = 24: the last column tile and reduction step of both products are partial."""
    dtype, experts, tokens, top_k, hidden, intermediate = torch.float16, 8, 9, 2, 80, 24
    gate_up, down = make_experts(experts, dtype, hidden, intermediate)
    x = make_tokens(tokens, dtype, hidden)
    indices, weights = uniform_routing(tokens, top_k, experts)
    out = fused_experts(x, indices, weights, gate_up, down, **SMALL_BLOCKS)
    assert_close(out, loop_reference(x, indices, weights, gate_up, down), dtype)


def test_reads_strided_views():
    """x a slice of wider rows, the weights slices of padded storage (a row stride that is not the width),
    indices int32 and transposed, weights transposed: only the last dims of x and the weights are contiguous."""
    dtype, experts, tokens, top_k = torch.float16, 8, 11, 2
    gate_up, down = make_experts(experts, dtype)
    x = make_tokens(tokens, dtype)
    indices, weights = uniform_routing(tokens, top_k, experts)
    wide_x = torch.zeros(tokens, 2 * HIDDEN, dtype=dtype, device=DEVICE)
    wide_x[:, HIDDEN:] = x
    padded_gate_up = torch.full((experts, 2 * INTERMEDIATE, HIDDEN + 16), float("nan"), dtype=dtype, device=DEVICE)
    padded_gate_up[..., :HIDDEN] = gate_up
    padded_down = torch.full((experts, HIDDEN, INTERMEDIATE + 8), float("nan"), dtype=dtype, device=DEVICE)
    padded_down[..., :INTERMEDIATE] = down
    out = fused_experts(
        wide_x[:, HIDDEN:],
        indices.to(torch.int32).T.contiguous().T,
        weights.T.contiguous().T,
        padded_gate_up[..., :HIDDEN],
        padded_down[..., :INTERMEDIATE],
        **SMALL_BLOCKS,
    )
    assert out.isfinite().all()
    assert_close(out, loop_reference(x, indices, weights, gate_up, down), dtype)


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("tokens", [13, 600])
def test_pairs_are_grouped_by_expert_in_token_order_and_padded(tokens, block_m):
    """13 tokens: expert 6 gets every token's first slot and expert 2 most tokens' second; 600 tokens x 8
    slots: more pairs than the align kernel reads in one step."""
    experts, top_k = 16, 3 if tokens < 100 else 8
    assert tokens < 100 or tokens * top_k > MAX_PAIRS_CHUNK
    indices, _ = uniform_routing(tokens, top_k, experts)
    indices[:, 0] = 6
    indices[:, 1] = torch.where(torch.arange(tokens, device=DEVICE) < 12, 2, indices[:, 1])
    sorted_pairs, block_experts = align_pairs(indices, experts, block_m)
    assert sorted_pairs.numel() == padded_rows(tokens * top_k, experts, block_m) == block_experts.numel() * block_m
    expected_pairs, expected_blocks = [], []
    flat = indices.flatten().tolist()
    for expert in range(experts):
        pairs = [pair for pair, chosen in enumerate(flat) if chosen == expert]
        blocks = -(-len(pairs) // block_m)
        expected_pairs += pairs + [tokens * top_k] * (blocks * block_m - len(pairs))
        expected_blocks += [expert] * blocks
    used = len(expected_pairs)
    assert sorted_pairs[:used].tolist() == expected_pairs
    assert block_experts.tolist() == expected_blocks + [-1] * (block_experts.numel() - len(expected_blocks))


def test_rejects_what_it_cannot_run():
    gate_up, down = make_experts(8, torch.float16)
    x = make_tokens(4, torch.float16)
    indices, weights = uniform_routing(4, 2, 8)
    with pytest.raises(ValueError, match="dtype"):
        fused_experts(x.float(), indices, weights, gate_up, down)
    with pytest.raises(ValueError, match="power of two"):
        fused_experts(x, indices, weights, gate_up, down, block_m=24)
    with pytest.raises(ValueError, match="router weights"):
        fused_experts(x, indices, weights.double(), gate_up, down)
    with pytest.raises(ValueError, match="indices"):
        fused_experts(x, indices[:3], weights[:3], gate_up, down)


@pytest.mark.skipif(INTERPRETED, reason="CUDA graphs need a GPU")
def test_a_captured_graph_replays_for_new_routing():
    """The buffers and grids depend on N, k and E alone, so one capture serves any routing of N tokens."""
    dtype, experts, tokens, top_k = torch.bfloat16, 16, 32, 4
    gate_up, down = make_experts(experts, dtype, hidden=256, intermediate=128)
    x = make_tokens(tokens, dtype, hidden=256)
    indices, weights = uniform_routing(tokens, top_k, experts, seed=4)
    fused_experts(x, indices, weights, gate_up, down)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, indices, weights, gate_up, down)
    new_indices, new_weights = crowded_routing(tokens, experts)
    new_indices = torch.cat([new_indices, uniform_routing(tokens, 2, experts, seed=5)[0]], dim=1)
    new_weights = torch.cat([new_weights, new_weights], dim=1) / 2
    indices.copy_(new_indices)
    weights.copy_(new_weights)
    graph.replay()
    assert_close(out, grouped_mm_reference(x, indices, weights, gate_up, down), dtype)
