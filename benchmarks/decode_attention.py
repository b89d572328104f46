"""Decoding attention on one GPU: the Triton split-KV kernel against torch's flash attention forward.

    python benchmarks/decode_attention.py                 # Qwen3-0.6B's shape: 16 heads, 8 KV heads, dim 128
    python benchmarks/decode_attention.py --batch 32 --max-len 2048 --min-used 1024

Both read the KV cache in place as the engine does: flash attention through the engine's `flash_decode`
(each row's `group` query heads packed as its KV heads' queries, `seqused_k`), the Triton kernel
(`asyncrl.inference.kernels.decode_attention`) at its default split size and at a few other block and split sizes.
Each is timed as the engine runs it, replayed from a CUDA graph (20 calls per graph, the calls rotating over
`--layers` layers of the cache so that repeats do not hit in L2), with CUDA events after a warm-up. GB/s
counts the keys and values the rows use, read once. Max diffs: against flash attention's output and against
float32 attention.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
import torch.nn.functional as F

from asyncrl.inference.engine.model_runner import FLASH_DECODE, flash_decode
from asyncrl.inference.kernels.decode_attention import AVAILABLE, decode_attention, default_split_size

CALLS_PER_GRAPH = 20


def reference(q, keys, values, used) -> torch.Tensor:
    """Float32 attention of each row over its own keys."""
    group = q.shape[1] // keys.shape[2]
    rows = []
    for i, length in enumerate(used.tolist()):
        k = keys[i, :length].float().transpose(0, 1).repeat_interleave(group, dim=0)
        v = values[i, :length].float().transpose(0, 1).repeat_interleave(group, dim=0)
        rows.append(F.scaled_dot_product_attention(q[i].float()[:, None], k, v)[:, 0])
    return torch.stack(rows)


def time_per_call(attend, layers: int, iters: int) -> float:
    """Microseconds per call of `attend(layer)`, replayed from a CUDA graph of CALLS_PER_GRAPH calls."""
    for layer in range(layers):
        attend(layer)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in range(CALLS_PER_GRAPH):
            attend(call % layers)
    for _ in range(3):
        graph.replay()
    replays = max(1, iters // CALLS_PER_GRAPH)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * CALLS_PER_GRAPH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=384, help="slot length, and the context bound")
    parser.add_argument("--min-used", type=int, default=128, help="used lengths are uniform in [min-used, max-len]")
    parser.add_argument("--layers", type=int, default=4, help="cache layers the calls rotate over")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_attention benchmark: no CUDA device (run it on a machine with an NVIDIA GPU)")
    if not AVAILABLE:
        sys.exit("decode_attention benchmark: triton is not importable (install the CUDA build of torch)")

    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    batch, heads, kv_heads, dim, max_len = args.batch, args.heads, args.kv_heads, args.dim, args.max_len
    generator = torch.Generator(device=device).manual_seed(args.seed)
    shape = (args.layers, batch, max_len, kv_heads, dim)
    cache_keys = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    cache_values = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    queries = torch.randn(args.layers, batch, heads, dim, generator=generator, device=device, dtype=dtype)
    used = torch.randint(args.min_used, max_len + 1, (batch,), generator=generator, device=device, dtype=torch.int32)
    context = max_len
    group = heads // kv_heads
    slots = torch.arange(batch + 1, dtype=torch.int32, device=device)
    query_starts, key_starts = slots * group, slots * max_len
    read_bytes = 2 * int(used.sum()) * kv_heads * dim * cache_keys.element_size()

    def triton_decode(layer: int, block_n: int, split_size: int) -> torch.Tensor:
        return decode_attention(
            queries[layer],
            cache_keys[layer],
            cache_values[layer],
            used,
            context,
            block_n=block_n,
            split_size=split_size,
        )

    variants = []  # (name, splits, attend(layer))
    if FLASH_DECODE is not None:
        variants.append(
            (
                "flash (aten)",
                "-",
                lambda layer: flash_decode(
                    queries[layer], cache_keys[layer], cache_values[layer], used, context, query_starts, key_starts
                ),
            )
        )
    for block_n in (32, 64, 128):
        default = default_split_size(batch * kv_heads, context, block_n, device)
        for split_size in sorted({default, 128, 256, -(-context // block_n) * block_n}):
            if split_size % block_n:
                continue
            name = f"triton block {block_n} split {split_size}" + (" (default)" if split_size == default else "")
            attend = functools.partial(triton_decode, block_n=block_n, split_size=split_size)
            variants.append((name, str(-(-context // split_size)), attend))

    expected = reference(queries[0], cache_keys[0], cache_values[0], used)
    flash_out = variants[0][2](0).float() if FLASH_DECODE is not None else None
    print(
        f"{torch.cuda.get_device_name()}: batch {batch}, {heads} heads / {kv_heads} KV heads, dim {dim}, "
        f"{args.dtype}, max_len {max_len}, used in [{args.min_used}, {max_len}] (mean {used.float().mean():.0f}), "
        f"{read_bytes / 1e6:.1f} MB of keys and values per call"
    )
    if FLASH_DECODE is None:
        print("torch has no _flash_attention_forward with seqused_k: flash attention is not timed")
    print(f"{'variant':<36} {'splits':>6} {'us/call':>8} {'GB/s':>7} {'speedup':>8} {'vs flash':>9} {'vs fp32':>8}")
    baseline = None
    for name, splits, attend in variants:
        microseconds = time_per_call(attend, args.layers, args.iters)
        baseline = baseline or microseconds
        out = attend(0).float()
        versus_flash = f"{(out - flash_out).abs().max().item():.2e}" if flash_out is not None else "-"
        versus_fp32 = (out - expected).abs().max().item()
        print(
            f"{name:<36} {splits:>6} {microseconds:>8.1f} {read_bytes / microseconds / 1e3:>7.0f} "
            f"{baseline / microseconds:>7.2f}x {versus_flash:>9} {versus_fp32:>8.2e}"
        )


if __name__ == "__main__":
    main()
