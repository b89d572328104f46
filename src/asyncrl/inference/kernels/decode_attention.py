"""Decoding attention on the GPU: each row's one new query token against its own slot of the KV cache.

torch's flash attention forward (varlen, `seqused_k`) gives each row's `group` query heads a 128-row query
tile and walks the keys in one program, so a decoding step with short contexts keeps HBM about half busy.
Here ("flash decoding"):

- One program per (row, KV head, split of the keys). Its query tile holds the `group` query heads that
  share the KV head, padded to 16 rows (the smallest `tl.dot`), so each key and value is read once per row.
- The keys are split so that a small batch still fills the GPU; each split writes an unnormalized partial
  output with its running max and sum (float32), and a second kernel merges the splits. With one split the
  first kernel writes the output itself.
- The grid is sized from `context`, a host-side upper bound of the lengths, never from the lengths on the
  device: no host sync, and a CUDA graph captured for a context bucket replays for any lengths within it.
  Splits that start past a row's length write a neutral partial (max -inf, sum 0).
- A shared prompt: row i may read its first `prefix_lens[i]` keys and values from slot `prefix_slots[i]`
  (the slot that holds the prompt its request's samples share, written once by their prefill) and the rest
  from its own slot, at the same positions. The rows of one prompt are neighbours in the grid, so their
  programs read the shared keys close together in time, mostly from L2.

Triton may be absent (`triton_import.py`; `AVAILABLE` says whether it is there).
"""

from __future__ import annotations

import functools
import math

import torch

from asyncrl.inference.kernels.triton_import import AVAILABLE, tl, triton

# Programs the grid should at least have, per multiprocessor: two, so that one waiting on memory leaves the
# multiprocessor another to run (the rule flash attention's split heuristic also follows).
PROGRAMS_PER_MULTIPROCESSOR = 2
# The multiprocessor count assumed off CUDA (the interpreter): an H100's or H200's.
DEFAULT_MULTIPROCESSORS = 132
# tl.dot needs at least 16 rows.
MIN_QUERY_TILE = 16
LOG2_E = 1.4426950408889634


if AVAILABLE:

    @triton.jit
    def _split_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        used_ptr,
        prefix_slots_ptr,
        prefix_lens_ptr,
        out_ptr,
        acc_ptr,
        max_ptr,
        sum_ptr,
        stride_q_row,
        stride_q_head,
        stride_k_slot,
        stride_k_pos,
        stride_k_head,
        stride_v_slot,
        stride_v_pos,
        stride_v_head,
        stride_out_row,
        stride_out_head,
        scale_log2,
        split_size,
        num_splits,
        GROUP: tl.constexpr,
        QUERY_TILE: tl.constexpr,
        DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SINGLE_SPLIT: tl.constexpr,
        SHARED_PREFIX: tl.constexpr,
    ):
        """Online softmax (base 2, float32) of one row's `GROUP` query heads over one split of its KV head's
        keys. SINGLE_SPLIT: the split is all keys, so normalize and write the output; else write the
        unnormalized partial output, its max and its sum to the float32 scratch. SHARED_PREFIX: positions
        below the row's prefix length are read from its prefix slot."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        # int64: slot offsets of a large cache pass 2^31 elements.
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
        length = tl.load(used_ptr + row)
        if SHARED_PREFIX:
            prefix_slot = tl.load(prefix_slots_ptr + row).to(tl.int64)
            prefix_len = tl.load(prefix_lens_ptr + row)
        else:  # the row's own slot throughout: its base address once
            keys += row64 * stride_k_slot
            values += row64 * stride_v_slot
        start = split * split_size
        end = tl.minimum(start + split_size, length)

        running_max = tl.full([QUERY_TILE], float("-inf"), tl.float32)
        running_sum = tl.zeros([QUERY_TILE], tl.float32)
        acc = tl.zeros([QUERY_TILE, DIM], tl.float32)
        # An empty split (start >= length) runs no iteration and keeps the neutral (-inf, 0, 0).
        for first in range(start, end, BLOCK_N):
            positions = first + offsets
            valid = positions < end
            if SHARED_PREFIX:
                slots = tl.where(positions < prefix_len, prefix_slot, row64)
                block_keys = keys + slots[:, None] * stride_k_slot
                block_values = values + slots[:, None] * stride_v_slot
            else:
                block_keys, block_values = keys, values
            k = tl.load(block_keys + positions[:, None] * stride_k_pos + dims[None, :], mask=valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale_log2
            # Every block holds at least one valid key, so the max below is finite.
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            rescale = tl.exp2(running_max - new_max)
            weights = tl.exp2(scores - new_max[:, None])
            running_sum = running_sum * rescale + tl.sum(weights, 1)
            v = tl.load(
                block_values + positions[:, None] * stride_v_pos + dims[None, :], mask=valid[:, None], other=0.0
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
            # Scratch [batch, heads, splits(, dim)], contiguous.
            partial = (row64 * tl.num_programs(1) * GROUP + heads) * num_splits + split
            tl.store(max_ptr + partial, running_max, mask=is_query)
            tl.store(sum_ptr + partial, running_sum, mask=is_query)
            tl.store(acc_ptr + partial[:, None] * DIM + dims[None, :], acc, mask=is_query[:, None])

    @triton.jit
    def _combine_kernel(
        out_ptr,
        acc_ptr,
        max_ptr,
        sum_ptr,
        stride_out_row,
        stride_out_head,
        num_splits,
        DIM: tl.constexpr,
    ):
        """One (row, query head): the splits' partial outputs rescaled to their common max, summed, divided
        by the summed sums. Split 0 is never empty (length >= 1), so the max stays finite and an empty
        split's weight is exp2(-inf) = 0."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        dims = tl.arange(0, DIM)
        first = (row.to(tl.int64) * tl.num_programs(1) + head) * num_splits
        total_max = tl.load(max_ptr + first)
        total_sum = tl.load(sum_ptr + first)
        acc = tl.load(acc_ptr + first * DIM + dims)
        for split in range(1, num_splits):
            split_max = tl.load(max_ptr + first + split)
            new_max = tl.maximum(total_max, split_max)
            old_weight = tl.exp2(total_max - new_max)
            split_weight = tl.exp2(split_max - new_max)
            total_sum = total_sum * old_weight + tl.load(sum_ptr + first + split) * split_weight
            acc = acc * old_weight + tl.load(acc_ptr + (first + split) * DIM + dims) * split_weight
            total_max = new_max
        out = acc / total_sum
        tl.store(out_ptr + row * stride_out_row + head * stride_out_head + dims, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_split_size(programs: int, context: int, block_n: int, device: torch.device) -> int:
    """Keys per split: as few splits as give the grid `PROGRAMS_PER_MULTIPROCESSOR` programs per
    multiprocessor (each split costs a partial write and the merge), at most one split per key block. A
    multiple of `block_n`. `programs`: rows x KV heads."""
    blocks = -(-context // block_n)
    wanted = PROGRAMS_PER_MULTIPROCESSOR * _multiprocessors(device)
    splits = max(1, min(blocks, -(-wanted // programs)))
    return -(-blocks // splits) * block_n


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    used: torch.Tensor,
    context: int,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    split_size: int | None = None,
    prefix_slots: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(dim)) v for each row and query head, in q's dtype.

    q: [batch, heads, dim], heads = kv_heads x group; query head h reads KV head h // group.
    keys, values: [slots, max_len, kv_heads, dim] (slots >= batch; slot i holds row i's keys), any strides
    with the last dim contiguous: views of the [layer, slot, position, kv head, dim] cache.
    used: [batch] integers on q's device; row i attends to keys 0..used[i]-1, 1 <= used[i] <= context.
    context: a host-side bound of used (the graph bucket's), which sizes the grid; lengths past it are
    silently cut to the first splits' keys, so it must hold.
    out: [batch, heads, dim] in q's dtype, last dim contiguous; a new tensor when None.
    block_n: keys per inner step, a power of two >= 16 (dim 256 with 128 may not fit shared memory).
    split_size: keys per split, a multiple of block_n; None chooses one (`default_split_size`).
    prefix_slots, prefix_lens: [batch] integers on q's device, both or neither: row i reads positions below
    prefix_lens[i] from slot prefix_slots[i] (a shared prompt), the others from slot i. Lengths of 0: own
    slot only.
    dim: a power of two, 16 to 256. float32 inputs go through tl.dot as tf32 on the GPU.
    """
    if not AVAILABLE:
        raise RuntimeError("decode_attention needs triton (install a torch build with CUDA, which brings it)")
    batch, heads, dim = q.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    if group < 1 or heads != kv_heads * group:
        raise ValueError(f"{heads} query heads over {kv_heads} KV heads: need the same whole number per KV head")
    if context < 1:
        raise ValueError(f"context {context}: need an upper bound of the used lengths, at least 1")
    if dim & (dim - 1) or not 16 <= dim <= 256:
        raise ValueError(f"head dim {dim}: decode_attention takes powers of two from 16 to 256")
    if block_n & (block_n - 1) or block_n < 16:
        raise ValueError(f"block_n {block_n}: need a power of two >= 16")
    if keys.shape[0] < batch or keys.shape[3] != dim or values.shape != keys.shape:
        raise ValueError(f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not fit q {tuple(q.shape)}")
    if out is None:
        out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    if any(t.stride(-1) != 1 for t in (q, keys, values, out)):
        raise ValueError("q, keys, values and out need a contiguous last (head) dim")
    shared = prefix_slots is not None
    if shared != (prefix_lens is not None):
        raise ValueError("give prefix_slots and prefix_lens together")
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
    _split_kernel[(batch, kv_heads, num_splits)](
        q,
        keys,
        values,
        used,
        prefix_slots if shared else used,  # unread without SHARED_PREFIX
        prefix_lens if shared else used,
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
        out.stride(0),
        out.stride(1),
        LOG2_E / math.sqrt(dim),
        split_size,
        num_splits,
        GROUP=group,
        QUERY_TILE=max(MIN_QUERY_TILE, triton.next_power_of_2(group)),
        DIM=dim,
        BLOCK_N=block_n,
        SINGLE_SPLIT=single,
        SHARED_PREFIX=shared,
        num_warps=4,
        num_stages=2,
    )
    if not single:
        _combine_kernel[(batch, heads)](
            out, acc, maximum, total, out.stride(0), out.stride(1), num_splits, DIM=dim, num_warps=1
        )
    return out
