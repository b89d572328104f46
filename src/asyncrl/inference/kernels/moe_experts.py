"""The experts of one mixture-of-experts layer for a decoding batch (1 to a few hundred tokens), in Triton.

A decoding step of a MoE model is bound by memory: with 128 tokens routed to 8 of 128 experts, nearly every
expert gets a few tokens, so each step reads nearly all the experts' weights (Qwen3-30B-A3B: 1.2 GB per
layer in bf16) to do little arithmetic with them. The training path (`asyncrl.models.moe.Experts`) sorts the
token-expert pairs with a handful of torch operations and runs `F.grouped_mm` twice; this module does the
same arithmetic in three small Triton kernels plus one sum, aiming to stream the weights at the GPU's
bandwidth (the scheme of vLLM's fused_moe):

1. **Align** (`_align_kernel`, one program per expert): the pairs (token n, slot j) are grouped by expert, in
   token order, each expert's group padded to a multiple of `block_m` rows with a sentinel pair (= N·k, no
   token). Out come `sorted_pairs` (the pair of each padded row) and `block_experts` (the expert of each
   block of `block_m` rows, -1 past the last used block). Everything stays on the device: the buffers are
   sized by the bound N·k + min(E, N·k)·(block_m - 1) rows, so no host sync and no allocation that depends on
   the routing; a CUDA graph holds the whole layer.
2. **gate_up** (`_gate_up_kernel`, one program per block of rows × tile of `block_n` intermediate columns):
   the block's token rows of x (gathered, the sentinel reading zeros) times its expert's gate and up rows,
   both accumulated in float32 over H; the epilogue applies SwiGLU, silu(gate) · up, and writes the padded
   intermediate [rows, I].
3. **down** (`_down_kernel`, one program per block × tile of `block_n` output columns): the intermediate rows
   times the expert's down projection, accumulated in float32 over I; the epilogue multiplies by the pair's
   router weight and writes the pair's row of a [N·k, H] buffer (padding rows are not written).
4. **sum**: the k rows of each token summed in float32 (torch's sum over a [N, k, H] view): deterministic,
   no atomics.

Rounding follows the reference (`grouped_swiglu` and `Experts.forward` in x's dtype): the projections' outputs
are rounded to x's dtype before SwiGLU, silu(gate) and its product with up are each rounded, the down
projection's output is rounded before it is multiplied by the router weight (float32 or x's dtype), and that
product is rounded again. Only the order of the float32 accumulation and of the final sum differ (the
reference adds the k rows in x's dtype, this module in float32 and rounds once).

The weights are read in transformers' in-memory layout: gate_up [E, 2I, H] (gate = its first I rows, up = the
next I), down [E, H, I], any strides with the last dim contiguous (views of a larger tensor are fine). Blocks
of rows of one expert are neighbours in the grid's fastest axis, so an expert with more than `block_m` pairs
reads each weight tile from HBM about once and from L2 after that.

Triton may be absent (`triton_import.py`; `AVAILABLE` says whether it is there).
"""

from __future__ import annotations

import torch

from asyncrl.inference.kernels.triton_import import AVAILABLE, tl, triton

# tl.dot needs at least 16 rows, columns and reduction length.
MIN_DOT = 16
# Pairs the align kernel reads in one step: a decoding batch's N·k (512 x 8) in one.
MAX_PAIRS_CHUNK = 4096
# Unused blocks the align kernel marks per step.
UNUSED_BLOCKS_CHUNK = 256

if AVAILABLE:

    @triton.jit
    def _align_kernel(
        indices_ptr,
        sorted_pairs_ptr,
        block_experts_ptr,
        stride_indices_token,
        stride_indices_slot,
        num_pairs,
        top_k,
        num_blocks,
        NUM_EXPERTS: tl.constexpr,
        BINS: tl.constexpr,
        PAIRS_CHUNK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        UNUSED_CHUNK: tl.constexpr,
    ):
        """Program e: counts every expert's pairs (a histogram, so it knows where its padded group starts),
        then writes its own pairs in token order (a prefix sum of "is mine"), its padding (the sentinel
        `num_pairs`) and the expert of each of its blocks. The last program also marks the unused blocks up to
        `num_blocks` with -1. BINS: a power of two above NUM_EXPERTS (the last bin takes the masked lanes).
        Decoding batches fit one PAIRS_CHUNK, so both loops run once: no chain of dependent steps."""
        expert = tl.program_id(0)
        chunk = tl.arange(0, PAIRS_CHUNK)

        counts = tl.zeros([BINS], dtype=tl.int32)
        for first in range(0, num_pairs, PAIRS_CHUNK):
            pairs = first + chunk
            ids = tl.load(
                indices_ptr + (pairs // top_k) * stride_indices_token + (pairs % top_k) * stride_indices_slot,
                mask=pairs < num_pairs,
                other=BINS - 1,
            )
            counts += tl.histogram(ids.to(tl.int32), BINS)
        experts = tl.arange(0, BINS)
        padded = tl.where(experts < NUM_EXPERTS, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        start = tl.sum(tl.where(experts < expert, padded, 0), axis=0)
        count = tl.sum(tl.where(experts == expert, counts, 0), axis=0)
        end = start + tl.sum(tl.where(experts == expert, padded, 0), axis=0)

        seen = 0
        for first in range(0, num_pairs, PAIRS_CHUNK):
            pairs = first + chunk
            ids = tl.load(
                indices_ptr + (pairs // top_k) * stride_indices_token + (pairs % top_k) * stride_indices_slot,
                mask=pairs < num_pairs,
                other=-1,
            )
            mine = (ids == expert).to(tl.int32)
            rank = seen + tl.cumsum(mine, axis=0) - 1
            tl.store(sorted_pairs_ptr + start + rank, pairs, mask=mine != 0)
            seen += tl.sum(mine, axis=0)
        padding = start + count + tl.arange(0, BLOCK_M)
        tl.store(sorted_pairs_ptr + padding, num_pairs, mask=padding < end)
        for block in range(start // BLOCK_M, end // BLOCK_M):
            tl.store(block_experts_ptr + block, expert)

        if expert == NUM_EXPERTS - 1:
            for first in range(end // BLOCK_M, num_blocks, UNUSED_CHUNK):
                blocks = first + tl.arange(0, UNUSED_CHUNK)
                tl.store(block_experts_ptr + blocks, -1, mask=blocks < num_blocks)

    @triton.jit
    def _gate_up_kernel(
        x_ptr,
        gate_up_ptr,
        sorted_pairs_ptr,
        block_experts_ptr,
        intermediate_ptr,
        stride_x_token,
        stride_gate_up_expert,
        stride_gate_up_row,
        stride_intermediate_row,
        num_pairs,
        top_k,
        hidden,
        intermediate,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        """One block of `BLOCK_M` rows (pairs of one expert) × `BLOCK_N` intermediate columns:
        silu(x Gᵀ) · (x Uᵀ), both products accumulated in float32 over the hidden size, each rounded to x's
        dtype as the reference rounds them. EVEN_K: the hidden size is a multiple of BLOCK_K (no mask on K)."""
        block = tl.program_id(0)
        column_tile = tl.program_id(1)
        expert = tl.load(block_experts_ptr + block)
        if expert < 0:  # past the last used block
            return
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_pairs_ptr + rows)
        is_pair = pairs < num_pairs
        tokens = tl.where(is_pair, pairs // top_k, 0).to(tl.int64)
        columns = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        is_column = columns < intermediate
        offsets_k = tl.arange(0, BLOCK_K)

        x_rows = x_ptr + tokens[:, None] * stride_x_token + offsets_k[None, :]
        weights = gate_up_ptr + expert.to(tl.int64) * stride_gate_up_expert + offsets_k[:, None]
        gate_columns = weights + columns[None, :].to(tl.int64) * stride_gate_up_row
        up_columns = weights + (intermediate + columns[None, :]).to(tl.int64) * stride_gate_up_row

        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for first in range(0, hidden, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_rows, mask=is_pair[:, None], other=0.0)
                g = tl.load(gate_columns, mask=is_column[None, :], other=0.0)
                u = tl.load(up_columns, mask=is_column[None, :], other=0.0)
            else:
                in_k = first + offsets_k < hidden
                a = tl.load(x_rows, mask=is_pair[:, None] & in_k[None, :], other=0.0)
                g = tl.load(gate_columns, mask=in_k[:, None] & is_column[None, :], other=0.0)
                u = tl.load(up_columns, mask=in_k[:, None] & is_column[None, :], other=0.0)
            gate = tl.dot(a, g, gate)
            up = tl.dot(a, u, up)
            x_rows += BLOCK_K
            gate_columns += BLOCK_K
            up_columns += BLOCK_K

        dtype = intermediate_ptr.dtype.element_ty
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        activated = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        tl.store(
            intermediate_ptr + rows[:, None].to(tl.int64) * stride_intermediate_row + columns[None, :],
            (activated * up).to(dtype),
            mask=is_column[None, :],
        )

    @triton.jit
    def _down_kernel(
        intermediate_ptr,
        down_ptr,
        sorted_pairs_ptr,
        block_experts_ptr,
        router_weights_ptr,
        pair_out_ptr,
        stride_intermediate_row,
        stride_down_expert,
        stride_down_row,
        stride_router_token,
        stride_router_slot,
        stride_pair_out,
        num_pairs,
        top_k,
        hidden,
        intermediate,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        """One block of `BLOCK_M` rows × `BLOCK_N` hidden columns: the intermediate rows times the expert's
        down projection (float32 over I), rounded, times each pair's router weight, rounded, written to the
        pair's row of the [N·k, H] buffer. EVEN_K: I is a multiple of BLOCK_K."""
        block = tl.program_id(0)
        column_tile = tl.program_id(1)
        expert = tl.load(block_experts_ptr + block)
        if expert < 0:
            return
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_pairs_ptr + rows)
        is_pair = pairs < num_pairs
        columns = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        is_column = columns < hidden
        offsets_k = tl.arange(0, BLOCK_K)

        a_rows = intermediate_ptr + rows[:, None].to(tl.int64) * stride_intermediate_row + offsets_k[None, :]
        b_columns = (
            down_ptr
            + expert.to(tl.int64) * stride_down_expert
            + columns[None, :].to(tl.int64) * stride_down_row
            + offsets_k[:, None]
        )
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for first in range(0, intermediate, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_rows)
                b = tl.load(b_columns, mask=is_column[None, :], other=0.0)
            else:
                in_k = first + offsets_k < intermediate
                a = tl.load(a_rows, mask=in_k[None, :], other=0.0)
                b = tl.load(b_columns, mask=in_k[:, None] & is_column[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            a_rows += BLOCK_K
            b_columns += BLOCK_K

        dtype = pair_out_ptr.dtype.element_ty
        safe_pairs = tl.where(is_pair, pairs, 0)
        router = tl.load(
            router_weights_ptr
            + (safe_pairs // top_k) * stride_router_token
            + (safe_pairs % top_k) * stride_router_slot,
            mask=is_pair,
            other=0.0,
        ).to(tl.float32)
        out = (acc.to(dtype).to(tl.float32) * router[:, None]).to(dtype)
        tl.store(
            pair_out_ptr + safe_pairs[:, None].to(tl.int64) * stride_pair_out + columns[None, :],
            out,
            mask=is_pair[:, None] & is_column[None, :],
        )


def padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound of the rows once each expert's pairs are padded to a multiple of block_m, as a multiple
    of block_m: at most min(E, pairs) experts have pairs, each padded by at most block_m - 1."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_pairs(indices: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-expert pairs of `indices` [N, k] grouped by expert (token order within each) and padded per
    expert to a multiple of block_m: (`sorted_pairs` [rows] int32, the pair n·k + j of each row or N·k for
    padding; `block_experts` [rows / block_m] int32, each block's expert or -1 past the used ones). Rows past
    the used blocks are left unwritten. Sized by `padded_rows`, never by the routing."""
    num_pairs = indices.numel()
    rows = padded_rows(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=indices.device)
    block_experts = torch.empty(rows // block_m, dtype=torch.int32, device=indices.device)
    _align_kernel[(num_experts,)](
        indices,
        sorted_pairs,
        block_experts,
        indices.stride(0),
        indices.stride(1),
        num_pairs,
        indices.shape[1],
        rows // block_m,
        NUM_EXPERTS=num_experts,
        BINS=triton.next_power_of_2(num_experts + 1),
        PAIRS_CHUNK=max(MIN_DOT, min(MAX_PAIRS_CHUNK, triton.next_power_of_2(num_pairs))),
        BLOCK_M=block_m,
        UNUSED_CHUNK=UNUSED_BLOCKS_CHUNK,
        num_warps=4,
    )
    return sorted_pairs, block_experts


def default_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: 16 while experts get fewer than 12 pairs on average (decoding up to ~200 tokens at
    E=128, k=8), else 32, which reads each expert's weight tiles once where 16 would split them over two
    blocks (measured on one H200 at Qwen3-30B-A3B's shape: 16 is best at 128 tokens, 32 at 256)."""
    return 16 if num_pairs < 12 * num_experts else 32


def _check_block(name: str, value: int) -> None:
    if value & (value - 1) or value < MIN_DOT:
        raise ValueError(f"{name} {value}: need a power of two >= {MIN_DOT}")


def fused_experts(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    block_m: int | None = None,
    gate_up_block_n: int = 64,
    gate_up_block_k: int = 128,
    down_block_n: int = 64,
    down_block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """sum over j of weights[n, j] · down[e] (silu(gate[e] x[n]) · up[e] x[n]), e = indices[n, j], for each
    token n: the experts part of one MoE layer, as `asyncrl.models.moe.Experts.forward` computes it.

    x: [N, H] bfloat16 or float16 (float32 also runs; on the GPU its products go through tl.dot as tf32),
    last dim contiguous. indices: [N, k] integers in [0, E) (any integer dtype, any strides). weights: [N, k]
    the router's weights, float32 or x's dtype (any strides). gate_up: [E, 2I, H], gate = rows 0..I-1 and
    up = rows I..2I-1 of each expert; down: [E, H, I]; both in x's dtype with the last dim contiguous, other
    strides free. All on one device. Returns a new [N, H] tensor in x's dtype.

    Block sizes (powers of two >= 16): `block_m` rows of one expert per program (each expert's pairs are
    padded to a multiple of it; None: `default_block_m`, 16 or 32 by the pairs per expert); `gate_up_block_n`
    intermediate columns (each program reads that many gate rows and as many up rows) and `gate_up_block_k`
    hidden elements per step; `down_block_n` hidden columns and `down_block_k` intermediate elements per step.
    `num_warps`, `num_stages`: Triton's, for both matrix kernels. No host sync and no allocation sized by the
    routing: a CUDA graph can hold the call.
    """
    if not AVAILABLE:
        raise RuntimeError("fused_experts needs triton (install a torch build with CUDA, which brings it)")
    tokens, hidden = x.shape
    num_experts, double_intermediate, _ = gate_up.shape
    intermediate = double_intermediate // 2
    top_k = indices.shape[1] if indices.dim() == 2 else -1
    if indices.shape != (tokens, top_k) or weights.shape != indices.shape:
        raise ValueError(f"indices {tuple(indices.shape)} and weights {tuple(weights.shape)}: need [{tokens}, k]")
    if gate_up.shape != (num_experts, 2 * intermediate, hidden) or down.shape != (num_experts, hidden, intermediate):
        raise ValueError(
            f"gate_up {tuple(gate_up.shape)} / down {tuple(down.shape)}: need [E, 2I, {hidden}] and [E, {hidden}, I]"
        )
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"gate_up {gate_up.dtype} / down {down.dtype}: need x's dtype {x.dtype}")
    if weights.dtype not in (torch.float32, x.dtype):
        raise ValueError(f"router weights {weights.dtype}: need float32 or x's dtype {x.dtype}")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(f"indices {indices.dtype}: need integers")
    if any(t.stride(-1) != 1 for t in (x, gate_up, down)):
        raise ValueError("x, gate_up and down need a contiguous last dim")
    if block_m is None:
        block_m = default_block_m(tokens * top_k, num_experts)
    for name, value in (
        ("block_m", block_m),
        ("gate_up_block_n", gate_up_block_n),
        ("gate_up_block_k", gate_up_block_k),
        ("down_block_n", down_block_n),
        ("down_block_k", down_block_k),
    ):
        _check_block(name, value)
    if tokens == 0:
        return x.new_zeros(tokens, hidden)

    num_pairs = tokens * top_k
    sorted_pairs, block_experts = align_pairs(indices, num_experts, block_m)
    num_blocks = block_experts.numel()
    # Rows of unused blocks stay unwritten and unread.
    activations = torch.empty(num_blocks * block_m, intermediate, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(intermediate, gate_up_block_n))](
        x,
        gate_up,
        sorted_pairs,
        block_experts,
        activations,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        activations.stride(0),
        num_pairs,
        top_k,
        hidden,
        intermediate,
        BLOCK_M=block_m,
        BLOCK_N=gate_up_block_n,
        BLOCK_K=gate_up_block_k,
        EVEN_K=hidden % gate_up_block_k == 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, down_block_n))](
        activations,
        down,
        sorted_pairs,
        block_experts,
        weights,
        pair_out,
        activations.stride(0),
        down.stride(0),
        down.stride(1),
        weights.stride(0),
        weights.stride(1),
        pair_out.stride(0),
        num_pairs,
        top_k,
        hidden,
        intermediate,
        BLOCK_M=block_m,
        BLOCK_N=down_block_n,
        BLOCK_K=down_block_k,
        EVEN_K=intermediate % down_block_k == 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if top_k == 1:
        return pair_out
    return pair_out.view(tokens, top_k, hidden).sum(dim=1)
