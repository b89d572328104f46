"""Sampling on the GPU in two Triton kernels, for rows with nothing but a temperature (no top-k / top-p /
min-p, no top logprobs): the common case of RL rollouts.

`sampling.sample` in torch passes over the [batch x vocab] logits a dozen times (divide, log-softmax, exp,
pad, block sums, gathers) in some twenty kernels: on an H200, at 128 x 151,936, 0.5 ms of GPU time and
0.4 ms of host launches per decoding step. Here the logits are read once, plus the one block each row's
draw falls in:

1. `_block_kernel`, one program per (row, block of the vocabulary): the block's max of logits / temperature,
   its sum of exp(x - max), and its argmax (for greedy rows).
2. `_choose_kernel`, one program per row: the row's log-sum-exp from the blocks' figures; the block masses'
   cumulative sum in float64; the block where the row's uniform draw falls; within it, the cumulative sum of
   exp(x - lse) in float64 and the token where the draw falls. Greedy rows take the argmax instead. The
   token's log-probability is x / temperature - lse.

The draw is the one `sampling.inverse_cdf` makes (same uniform, same two levels, float64 sums), so a
request's seed gives the same tokens here as in torch, up to float rounding at the edges of a token's share.
The kernels write the token ids for the next step's input and one float64 [batch, 2] table (token id,
logprob) that goes to the host in one copy.

Triton may be absent (`triton_import.py`; `AVAILABLE` says whether it is there).
"""

from __future__ import annotations

import torch

from asyncrl.inference.kernels.triton_import import AVAILABLE, tl, triton

BLOCK = 1024  # vocabulary entries per program of the first kernel, and per block of the draw


if AVAILABLE:

    @triton.jit
    def _block_kernel(
        logits_ptr,
        temperature_ptr,
        max_ptr,
        sum_ptr,
        argmax_ptr,
        stride_row,
        vocab,
        num_blocks,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        block = tl.program_id(1)
        columns = block * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + columns, mask=columns < vocab, other=float("-inf"))
        x = x.to(tl.float32) / tl.load(temperature_ptr + row)
        block_max = tl.max(x, 0)
        stat = row * num_blocks + block
        tl.store(max_ptr + stat, block_max)
        tl.store(sum_ptr + stat, tl.sum(tl.exp(x - block_max), 0))
        tl.store(argmax_ptr + stat, block * BLOCK + tl.argmax(x, 0))

    @triton.jit
    def _choose_kernel(
        logits_ptr,
        temperature_ptr,
        greedy_ptr,
        uniform_ptr,
        max_ptr,
        sum_ptr,
        argmax_ptr,
        token_ptr,
        table_ptr,
        stride_row,
        vocab,
        num_blocks,
        BLOCK: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        row = tl.program_id(0)
        blocks = tl.arange(0, BLOCKS)
        present = blocks < num_blocks
        stats = row * num_blocks + blocks
        block_max = tl.load(max_ptr + stats, mask=present, other=float("-inf"))
        block_sum = tl.load(sum_ptr + stats, mask=present, other=0.0)
        top = tl.max(block_max, 0)
        scaled = block_sum * tl.exp(block_max - top)  # each block's mass relative to the row's max
        lse = top + tl.log(tl.sum(scaled, 0))
        temperature = tl.load(temperature_ptr + row)
        logits = logits_ptr + row.to(tl.int64) * stride_row

        # Level 1: the block whose cumulative mass first exceeds u x the total (searchsorted, side right).
        mass = scaled.to(tl.float64)
        block_end = tl.cumsum(mass, 0)
        target = tl.load(uniform_ptr + row) * tl.sum(mass, 0)
        chosen = tl.minimum(tl.sum((block_end <= target).to(tl.int32), 0), num_blocks - 1)
        before = tl.sum(tl.where(blocks == chosen, block_end - mass, 0.0), 0)
        # Level 2: within that block, in the same units (mass relative to the row's max).
        columns = chosen * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits + columns, mask=columns < vocab, other=float("-inf")).to(tl.float32) / temperature
        weights = tl.exp(x - top)
        running = tl.cumsum(weights.to(tl.float64), 0)
        offset = tl.sum((running <= target - before).to(tl.int32), 0)
        # Rounding can leave the draw past the block's last token with mass: take that token.
        last = tl.max(tl.where(weights > 0, tl.arange(0, BLOCK), 0), 0)
        token = chosen * BLOCK + tl.minimum(offset, last)

        if tl.load(greedy_ptr + row):
            # The first block holding the row's max, and its first argmax: torch.argmax's tie rule.
            first = tl.min(tl.where(block_max == top, blocks, BLOCKS), 0)
            token = tl.load(argmax_ptr + row * num_blocks + first)
        token = token.to(tl.int64)
        logprob = tl.load(logits + token).to(tl.float32) / temperature - lse
        tl.store(token_ptr + row, token)
        tl.store(table_ptr + row * 2, token.to(tl.float64))
        tl.store(table_ptr + row * 2 + 1, logprob.to(tl.float64))


def sample_rows(
    logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [B, V] (any float dtype, last dim contiguous): drawn at `temperature`
    [B] float32 with `uniforms` [B] float64 in [0, 1), or the argmax where `greedy` [B] bool. Returns the
    token ids [B] int64 and a float64 table [B, 2] of (token id, log_softmax(logits / temperature)[token])."""
    if not AVAILABLE:
        raise RuntimeError("sample_rows needs triton (install a torch build with CUDA, which brings it)")
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("logits need a contiguous last (vocabulary) dim")
    if not (temperature.shape == greedy.shape == uniforms.shape == (rows,)):
        raise ValueError(f"temperature, greedy and uniforms need shape ({rows},)")
    if uniforms.dtype != torch.float64 or temperature.dtype != torch.float32:
        raise ValueError("uniforms must be float64 and temperature float32")
    num_blocks = triton.cdiv(vocab, BLOCK)
    device = logits.device
    block_max = torch.empty(rows, num_blocks, dtype=torch.float32, device=device)
    block_sum = torch.empty_like(block_max)
    block_argmax = torch.empty(rows, num_blocks, dtype=torch.int32, device=device)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    table = torch.empty(rows, 2, dtype=torch.float64, device=device)
    if rows == 0:
        return tokens, table
    _block_kernel[(rows, num_blocks)](
        logits, temperature, block_max, block_sum, block_argmax, logits.stride(0), vocab, num_blocks, BLOCK=BLOCK
    )
    _choose_kernel[(rows,)](
        logits,
        temperature,
        greedy,
        uniforms,
        block_max,
        block_sum,
        block_argmax,
        tokens,
        table,
        logits.stride(0),
        vocab,
        num_blocks,
        BLOCK=BLOCK,
        BLOCKS=triton.next_power_of_2(num_blocks),
    )
    return tokens, table
