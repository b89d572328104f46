"""Decoding attention over the paged KV cache: each row's one new query token against the blocks of its table.

The split-KV scheme of `decode_attention.py` (one program per row, KV head and split of the keys, the
`group` query heads of a KV head in one tile, the splits merged by its `_combine_kernel`), with one
change: a key block of `BLOCK_N` positions is gathered through the row's block table, position p from
offset p % BLOCK_SIZE of block `table[p // BLOCK_SIZE]`, so any block size works and no position needs its
sequence's blocks to be neighbours. Entries of a table past a row's length are never read (their positions
are masked), so the table may hold anything there.

Triton may be absent (`triton_import.py`; `AVAILABLE` says whether it is there).
"""

from __future__ import annotations

import math

import torch

from asyncrl.inference.kernels.decode_attention import LOG2_E, MIN_QUERY_TILE, default_split_size
from asyncrl.inference.kernels.triton_import import AVAILABLE, tl, triton

if AVAILABLE:
    from asyncrl.inference.kernels.decode_attention import _combine_kernel

    @triton.jit
    def _paged_split_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        used_ptr,
        out_ptr,
        acc_ptr,
        max_ptr,
        sum_ptr,
        stride_q_row,
        stride_q_head,
        stride_k_block,
        stride_k_pos,
        stride_k_head,
        stride_v_block,
        stride_v_pos,
        stride_v_head,
        stride_table_row,
        stride_out_row,
        stride_out_head,
        scale_log2,
        split_size,
        num_splits,
        GROUP: tl.constexpr,
        QUERY_TILE: tl.constexpr,
        DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        SINGLE_SPLIT: tl.constexpr,
    ):
        """Online softmax (base 2, float32) of one row's `GROUP` query heads over one split of its keys,
        gathered through its block table; as `decode_attention._split_kernel` otherwise."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        row64 = row.to(tl.int64)
        group_rows = tl.arange(0, QUERY_TILE)
        dims = tl.arange(0, DIM)
        offsets = tl.arange(0, BLOCK_N)
        is_query = group_rows < GROUP
        heads = kv_head * GROUP + group_rows

        q = tl.load(
            q_ptr + row64 * stride_q_row + heads[:, None] * stride_q_head + dims[None, :],
            mask=is_query[:, None],
            other=0.0,
        )
        keys = k_ptr + kv_head * stride_k_head
        values = v_ptr + kv_head * stride_v_head
        table = tables_ptr + row64 * stride_table_row
        length = tl.load(used_ptr + row)
        start = split * split_size
        end = tl.minimum(start + split_size, length)

        running_max = tl.full([QUERY_TILE], float("-inf"), tl.float32)
        running_sum = tl.zeros([QUERY_TILE], tl.float32)
        acc = tl.zeros([QUERY_TILE, DIM], tl.float32)
        for first in range(start, end, BLOCK_N):
            positions = first + offsets
            valid = positions < end
            # int64: block offsets of a large cache pass 2^31 elements.
            blocks = tl.load(table + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            within = positions % BLOCK_SIZE
            k = tl.load(
                keys + (blocks * stride_k_block + within * stride_k_pos)[:, None] + dims[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            scores = tl.dot(q, tl.trans(k)) * scale_log2
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            rescale = tl.exp2(running_max - new_max)
            weights = tl.exp2(scores - new_max[:, None])
            running_sum = running_sum * rescale + tl.sum(weights, 1)
            v = tl.load(
                values + (blocks * stride_v_block + within * stride_v_pos)[:, None] + dims[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
            running_max = new_max

        if SINGLE_SPLIT:
            out = acc / running_sum[:, None]
            tl.store(
                out_ptr + row64 * stride_out_row + heads[:, None] * stride_out_head + dims[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=is_query[:, None],
            )
        else:
            partial = (row64 * tl.num_programs(1) * GROUP + heads) * num_splits + split
            tl.store(max_ptr + partial, running_max, mask=is_query)
            tl.store(sum_ptr + partial, running_sum, mask=is_query)
            tl.store(acc_ptr + partial[:, None] * DIM + dims[None, :], acc, mask=is_query[:, None])


def paged_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_tables: torch.Tensor,
    used: torch.Tensor,
    context: int,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    split_size: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(dim)) v for each row and query head, in q's dtype, keys read through block tables.

    q: [batch, heads, dim], heads = kv_heads x group; query head h reads KV head h // group.
    keys, values: [blocks, block_size, kv_heads, dim], any strides with the last dim contiguous: views of the
    [layer, block, position, kv head, dim] cache (`engine/paged_cache.py`); block_size a power of two.
    block_tables: [batch, >= ceil(context / block_size)] integers on q's device: row i's position p is at
    offset p % block_size of block block_tables[i, p // block_size].
    used, context, out, block_n, split_size: as in `decode_attention.decode_attention`.
    """
    if not AVAILABLE:
        raise RuntimeError("paged_decode_attention needs triton (install a torch build with CUDA, which brings it)")
    batch, heads, dim = q.shape
    block_size, kv_heads = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    if group < 1 or heads != kv_heads * group:
        raise ValueError(f"{heads} query heads over {kv_heads} KV heads: need the same whole number per KV head")
    if context < 1:
        raise ValueError(f"context {context}: need an upper bound of the used lengths, at least 1")
    if dim & (dim - 1) or not 16 <= dim <= 256:
        raise ValueError(f"head dim {dim}: paged_decode_attention takes powers of two from 16 to 256")
    if block_n & (block_n - 1) or block_n < 16:
        raise ValueError(f"block_n {block_n}: need a power of two >= 16")
    if block_size & (block_size - 1):
        raise ValueError(f"block size {block_size}: need a power of two")
    if keys.shape[3] != dim or values.shape != keys.shape:
        raise ValueError(f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not fit q {tuple(q.shape)}")
    if block_tables.shape[0] < batch or block_tables.shape[1] * block_size < context:
        raise ValueError(
            f"block tables {tuple(block_tables.shape)} do not cover {batch} rows of {context} positions "
            f"in blocks of {block_size}"
        )
    if out is None:
        out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    if any(t.stride(-1) != 1 for t in (q, keys, values, out)):
        raise ValueError("q, keys, values and out need a contiguous last (head) dim")
    if split_size is None:
        split_size = default_split_size(batch * kv_heads, context, block_n, q.device)
    elif split_size % block_n:
        raise ValueError(f"split_size {split_size} is not a multiple of block_n {block_n}")
    num_splits = -(-context // split_size)
    single = num_splits == 1
    if single:
        acc = maximum = total = out  # unused: the split kernel writes out directly
    else:
        acc = torch.empty(batch, heads, num_splits, dim, dtype=torch.float32, device=q.device)
        maximum = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
        total = torch.empty_like(maximum)
    _paged_split_kernel[(batch, kv_heads, num_splits)](
        q,
        keys,
        values,
        block_tables,
        used,
        out,
        acc,
        maximum,
        total,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        LOG2_E / math.sqrt(dim),
        split_size,
        num_splits,
        GROUP=group,
        QUERY_TILE=max(MIN_QUERY_TILE, triton.next_power_of_2(group)),
        DIM=dim,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        SINGLE_SPLIT=single,
        num_warps=4,
        num_stages=2,
    )
    if not single:
        _combine_kernel[(batch, heads)](
            out, acc, maximum, total, out.stride(0), out.stride(1), num_splits, DIM=dim, num_warps=1
        )
    return out
