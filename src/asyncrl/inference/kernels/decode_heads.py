"""A decoding step's heads on the GPU: q/k norms, rotary embeddings and the KV-cache writes in one kernel.

Between the fused q/k/v projection and attention, `split_heads` (even compiled) with the position gathers
of the rotary tables and the two indexed cache writes take ~6 kernels per layer, ~0.45 ms of a 2.6 ms
decoding step on an H200 (28 layers). Here one program per (row, head of the q, k and v heads) reads its
head vector from the projection and:

- q and k heads: RMS norm with the head's weight (Qwen3; skipped without q/k norms), then rotary at the
  row's position, gathered from the tables by the kernel itself; q goes to a new [batch, heads, dim]
  tensor, k into the cache at (slot = row, position);
- v heads: copied into the cache as they are.

Each elementwise step rounds to the input dtype as eager torch does (float32 math, cast after each
operation, no fused multiply-adds), so in float16/bfloat16 it matches `split_heads` to the last bit or so
(the norm's sum and rsqrt may differ in float32's last bits). No host sync and no allocation sized by
device values: CUDA graphs capture it.

Triton may be absent (`triton_import.py`; `AVAILABLE` says whether it is there).
"""

from __future__ import annotations

import torch

from asyncrl.inference.kernels.triton_import import AVAILABLE, tl, triton

if AVAILABLE:

    @triton.jit
    def _mul(a, b, dtype: tl.constexpr):
        """a * b rounded to dtype, as eager torch multiplies two tensors of dtype."""
        return (a.to(tl.float32) * b.to(tl.float32)).to(dtype)

    @triton.jit
    def _heads_kernel(
        qkv_ptr,
        scale_ptr,
        cos_ptr,
        sin_ptr,
        positions_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        stride_qkv_row,
        stride_cos_pos,
        stride_sin_pos,
        stride_q_row,
        stride_q_head,
        stride_k_slot,
        stride_k_pos,
        stride_k_head,
        stride_v_slot,
        stride_v_pos,
        stride_v_head,
        eps,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        DIM: tl.constexpr,
        NORM: tl.constexpr,
        ROT: tl.constexpr,
    ):
        """Head `program_id(1)` of row `program_id(0)`: q heads, then k heads, then v heads."""
        # int64: slot offsets of a large cache pass 2^31 elements.
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        dtype = qkv_ptr.dtype.element_ty
        dims = tl.arange(0, DIM)
        source = qkv_ptr + row * stride_qkv_row + head * DIM
        position = tl.load(positions_ptr + row).to(tl.int64)
        if head < HEADS + KV_HEADS:
            # Each dimension's rotation partner (`rotary_partner`): roll(x[:ROT], ROT // 2)[d] =
            # x[(d + ROT // 2) % ROT] below ROT, itself above (its sine is 0); the partners read directly, so the
            # norm and rotary below are elementwise on both.
            rolled = tl.where(dims < ROT, (dims + ROT // 2) % ROT, dims)
            x = tl.load(source + dims)
            x_rolled = tl.load(source + rolled)
            if NORM:
                x32 = x.to(tl.float32)
                inverse = tl.rsqrt(tl.sum(x32 * x32, axis=0) / DIM + eps)
                weights = scale_ptr + head * DIM
                x = _mul(_mul(x, inverse, dtype), tl.load(weights + dims), dtype)
                x_rolled = _mul(_mul(x_rolled, inverse, dtype), tl.load(weights + rolled), dtype)
            cos = tl.load(cos_ptr + position * stride_cos_pos + dims)
            sin = tl.load(sin_ptr + position * stride_sin_pos + dims)
            out = (_mul(x, cos, dtype).to(tl.float32) + _mul(x_rolled, sin, dtype).to(tl.float32)).to(dtype)
            if head < HEADS:
                tl.store(q_ptr + row * stride_q_row + head * stride_q_head + dims, out)
            else:
                slot = k_ptr + row * stride_k_slot + position * stride_k_pos + (head - HEADS) * stride_k_head
                tl.store(slot + dims, out)
        else:
            slot = v_ptr + row * stride_v_slot + position * stride_v_pos + (head - HEADS - KV_HEADS) * stride_v_head
            tl.store(slot + dims, tl.load(source + dims))


def decode_heads(
    qkv: torch.Tensor,
    qk_scale: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    heads: int,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """`split_heads` of one decoding step with the cache writes: returns q [batch, heads, dim]; k and v go to
    `keys[i, positions[i]]`, `values[i, positions[i]]` for each row i.

    qkv: [batch, (heads + 2 kv_heads) x dim], the fused projection's output, last dim contiguous.
    qk_scale: the q then k norm weights, [heads + kv_heads, dim] contiguous; None: no q/k norms. eps: theirs.
    cos, sin: the rotary tables [max_len, dim] (`rotary_tables`: sin with the rotation's sign folded in, out =
    x cos + partner(x) sin), last dim contiguous. rotary_dim: the rotated dimensions of each head (default:
    all); the others have cos 1 and sin 0 in the tables.
    positions: [batch] integers on the device; each must be below the tables' and the cache's lengths
    (not checked: that would sync with the device).
    keys, values: [slots, max_len, kv_heads, dim] (slots >= batch; slot i is row i's), any strides with the
    last dim contiguous: views of the [layer, slot, position, kv head, dim] cache.
    All floating tensors share qkv's dtype; dim is a power of two.
    """
    if not AVAILABLE:
        raise RuntimeError("decode_heads needs triton (install a torch build with CUDA, which brings it)")
    if qkv.dim() != 2 or keys.dim() != 4:
        raise ValueError(f"qkv {tuple(qkv.shape)} / keys {tuple(keys.shape)}: need [batch, width] / 4 dims")
    batch = qkv.shape[0]
    slots, max_len, kv_heads, dim = keys.shape
    if dim < 2 or dim & (dim - 1):
        raise ValueError(f"head dim {dim}: decode_heads takes powers of two")
    if qkv.shape[1] != (heads + 2 * kv_heads) * dim:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} is not {heads} q + {kv_heads} k + {kv_heads} v heads of {dim} per row"
        )
    if values.shape != keys.shape or slots < batch:
        raise ValueError(f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not fit {batch} rows")
    if cos.dim() != 2 or cos.shape[1] != dim or sin.shape != cos.shape:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)}: need [max_len, {dim}] each")
    if qk_scale is not None and (qk_scale.shape != (heads + kv_heads, dim) or not qk_scale.is_contiguous()):
        raise ValueError(f"qk_scale {tuple(qk_scale.shape)}: need [{heads + kv_heads}, {dim}], contiguous")
    if positions.shape != (batch,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions {tuple(positions.shape)} {positions.dtype}: need [{batch}] integers")
    floats = [t for t in (cos, sin, keys, values, qk_scale) if t is not None]
    if any(t.dtype != qkv.dtype for t in floats):
        raise ValueError(f"qkv is {qkv.dtype}: cos, sin, keys, values and qk_scale need the same dtype")
    if any(t.stride(-1) != 1 for t in (qkv, cos, sin, keys, values)):
        raise ValueError("qkv, cos, sin, keys and values need a contiguous last dim")
    q = torch.empty(batch, heads, dim, dtype=qkv.dtype, device=qkv.device)
    _heads_kernel[(batch, heads + 2 * kv_heads)](
        qkv,
        qkv if qk_scale is None else qk_scale,  # unused without norms
        cos,
        sin,
        positions,
        q,
        keys,
        values,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        eps,
        HEADS=heads,
        KV_HEADS=kv_heads,
        DIM=dim,
        NORM=qk_scale is not None,
        ROT=rotary_dim or dim,
        num_warps=1,
        # Else the compiler folds a rounded product into the rotary sum as one fused multiply-add, skipping
        # the rounding eager torch does in between.
        enable_fp_fusion=False,
    )
    return q
