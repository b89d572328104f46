"""Paged decoding attention equals plain attention over each row's keys gathered through its block table.

Runs on a GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`, set before pytest starts);
skipped without triton or without either. As in `test_decode_attention.py`, the interpreter's bfloat16 tl.dot
is wrong, so there float16 and float32 stand in for it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_device import INTERPRETED, device_or_skip

from asyncrl.inference.kernels.paged_decode_attention import paged_decode_attention

DEVICE = device_or_skip()


def tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return 1e-2 if not INTERPRETED else 1e-5  # on the GPU tl.dot takes float32 as tf32
    return 2e-2


def make_blocks(num_blocks: int, block_size: int, kv_heads: int, dim: int, dtype, seed: int = 0):
    """Keys and values as the paged cache holds them: views of layer 1 of a [layer, block, position, kv, dim]
    tensor per kind."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, block_size, kv_heads, dim)
    keys = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
    values = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
    return keys[1], values[1]


def scattered_tables(used: list[int], block_size: int, num_blocks: int, width: int, seed: int = 3) -> torch.Tensor:
    """Each row's blocks drawn at random from the pool, none twice; the entries past its length are -1 (never
    read: a read would fault or show)."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = torch.full((len(used), width), -1, dtype=torch.int32)
    for row, length in enumerate(used):
        count = -(-length // block_size)
        tables[row, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    return tables.to(DEVICE)


def reference(q, keys, values, tables, used) -> torch.Tensor:
    """Float32 attention of each row over its first used[i] positions, gathered block by block."""
    block_size, group = keys.shape[1], q.shape[1] // keys.shape[2]
    rows = []
    for i, length in enumerate(used.tolist()):
        blocks = tables[i, : -(-length // block_size)].long()
        k = keys[blocks].flatten(0, 1)[:length].float().transpose(0, 1).repeat_interleave(group, dim=0)
        v = values[blocks].flatten(0, 1)[:length].float().transpose(0, 1).repeat_interleave(group, dim=0)
        rows.append(F.scaled_dot_product_attention(q[i].float()[:, None], k, v)[:, 0])
    return torch.stack(rows)


def queries(batch: int, heads: int, dim: int, dtype) -> torch.Tensor:
    return torch.randn(batch, heads, dim, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
@pytest.mark.parametrize("kv_heads,group,dim", [(2, 2, 32), (1, 4, 16)])
def test_matches_attention_over_each_rows_gathered_blocks(block_size, kv_heads, group, dim, dtype):
    """Blocks smaller than, equal to and larger than a key step (32); lengths of 1, of the whole context and
    in between, ending inside blocks and on their edges; several splits, of which short rows leave some empty."""
    context, used_list = 96, [1, 96, 37, 64]
    width = -(-context // block_size)
    num_blocks = sum(-(-n // block_size) for n in used_list) + 3
    keys, values = make_blocks(num_blocks, block_size, kv_heads, dim, dtype)
    tables = scattered_tables(used_list, block_size, num_blocks, width)
    used = torch.tensor(used_list, dtype=torch.int32, device=DEVICE)
    q = queries(len(used_list), kv_heads * group, dim, dtype)
    out = paged_decode_attention(q, keys, values, tables, used, context, block_n=32, split_size=32)
    expected = reference(q, keys, values, tables, used)
    torch.testing.assert_close(out.float(), expected, atol=tolerance(dtype), rtol=tolerance(dtype))


def test_one_split_writes_the_output_without_the_merge_and_agrees_with_many():
    keys, values = make_blocks(12, 8, 2, 16, torch.float32)
    tables = scattered_tables([40, 7], 8, 12, 5)
    used = torch.tensor([40, 7], dtype=torch.int32, device=DEVICE)
    q = queries(2, 4, 16, torch.float32)
    one = paged_decode_attention(q, keys, values, tables, used, 40, block_n=16, split_size=48)
    many = paged_decode_attention(q, keys, values, tables, used, 40, block_n=16, split_size=16)
    close = tolerance(torch.float32)
    torch.testing.assert_close(one, many, atol=close, rtol=close)
    torch.testing.assert_close(one, reference(q, keys, values, tables, used), atol=close, rtol=close)


def test_positions_past_a_rows_length_are_never_read():
    """NaN in every position no row uses, including the rest of each row's last block."""
    block_size = 8
    keys, values = make_blocks(6, block_size, 1, 16, torch.float32)
    used_list = [3, 13]
    tables = scattered_tables(used_list, block_size, 6, 2)
    clean_k, clean_v = torch.full_like(keys, float("nan")), torch.full_like(values, float("nan"))
    for row, length in enumerate(used_list):
        for position in range(length):
            block, within = tables[row, position // block_size], position % block_size
            clean_k[block, within], clean_v[block, within] = keys[block, within], values[block, within]
    used = torch.tensor(used_list, dtype=torch.int32, device=DEVICE)
    q = queries(2, 2, 16, torch.float32)
    out = paged_decode_attention(q, clean_k, clean_v, tables, used, 16, block_n=16)
    assert out.isfinite().all()
    close = tolerance(torch.float32)
    torch.testing.assert_close(out, reference(q, keys, values, tables, used), atol=close, rtol=close)


def test_tables_that_do_not_cover_the_context_are_refused():
    keys, values = make_blocks(4, 4, 1, 16, torch.float32)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    used = torch.tensor([8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="do not cover"):
        paged_decode_attention(queries(1, 1, 16, torch.float32), keys, values, tables, used, 12)
