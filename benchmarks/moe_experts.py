"""The experts of one MoE layer at decoding batch sizes on one GPU: the Triton kernels against `F.grouped_mm`.

    python benchmarks/moe_experts.py            # Qwen3-30B-A3B's experts, N = 1, 32, 128, 256, a few configs
    python benchmarks/moe_experts.py --quick    # two configs, fewer repetitions
    python benchmarks/moe_experts.py --sweep    # a wider grid of block sizes

Shape: H 2048, I 768, 128 experts, top 8 (Qwen3-30B-A3B), bf16, routing uniform at random (k distinct experts
per token, router weights a softmax in bf16 as Qwen3's router returns them). The reference is the training
path, `asyncrl.models.moe.Experts.forward` (sort the pairs, `F.grouped_mm` twice, weight and sum); the Triton
path is `asyncrl.inference.kernels.moe_experts.fused_experts` at each block config. Before timing, each
config's output is compared with the reference's and with a float32 loop over the experts (max abs diff).

Timing: CUDA events after a warm-up, the median over many repetitions, called eagerly (one call between two
events: launch overhead included) and replayed from a CUDA graph of `CALLS_PER_GRAPH` calls. The calls rotate
over `--layers` copies of the weights so that repeats do not hit in L2. "align" times the Triton path's first
kernel alone (grouping and padding the pairs). GB/s counts the bytes that must be read: the weights of each
expert that got at least one token, plus x, the output and the routing, over the graph-replayed time.

Figures: benchmarks/RESULTS.md, "Mixture of experts". The whole default run takes about 35 s on one H200.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from asyncrl.inference.kernels.moe_experts import AVAILABLE, align_pairs, default_block_m, fused_experts
from asyncrl.models.moe import Experts, Routing, expert_counts

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen3-30B-A3B
PEAK_BANDWIDTH = 4.8e12  # H200's datasheet, bytes/s
CALLS_PER_GRAPH = 10
# Outputs are O(1): two bf16 results of the same roundings differ by an ulp or two (2^-7 at 1) where their
# float32 sums were added in another order; more than this is a bug.
MAX_DIFFERENCE = 5e-2

# name -> fused_experts keyword arguments; the first is the module's defaults.
CONFIGS = {
    "default": {},
    "n32": dict(gate_up_block_n=32, down_block_n=32),
    "k64 s4": dict(gate_up_block_k=64, down_block_k=64, num_stages=4),
    "n128 w8": dict(gate_up_block_n=128, down_block_n=128, num_warps=8),
    "m16": dict(block_m=16),
    "m32": dict(block_m=32),
    "m64": dict(block_m=64),
}
SWEEP = {
    f"m{m} n{n} k{k} w{w} s{s}": dict(
        block_m=m, gate_up_block_n=n, down_block_n=n, gate_up_block_k=k, down_block_k=k, num_warps=w, num_stages=s
    )
    for m in (16, 32, 64)
    for n, k in ((16, 128), (32, 128), (64, 64), (64, 128), (128, 64))
    for w, s in ((4, 3), (4, 5), (8, 4))
}


def loop_reference(x, indices, weights, gate_up, down) -> torch.Tensor:
    """Float32, one expert at a time."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        tokens, slots = (indices == expert).nonzero(as_tuple=True)
        if tokens.numel():
            rows = x[tokens].float()
            gate, up = gate_up[expert].float().chunk(2, dim=0)
            y = (F.silu(rows @ gate.T) * (rows @ up.T)) @ down[expert].float().T
            out.index_add_(0, tokens, y * weights[tokens, slots, None].float())
    return out


def eager_ms(call, layers: int, reps: int) -> float:
    """Median milliseconds of one call between two CUDA events."""
    for layer in range(layers):
        call(layer)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize()
    for rep, (start, end) in enumerate(events):
        start.record()
        call(rep % layers)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def graph_ms(call, layers: int, replays: int) -> float:
    """Median milliseconds per call, replaying a CUDA graph of CALLS_PER_GRAPH calls."""
    for layer in range(layers):
        call(layer)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for index in range(CALLS_PER_GRAPH):
            call(index % layers)
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    del graph
    return statistics.median(start.elapsed_time(end) for start, end in events) / CALLS_PER_GRAPH


class Layers:
    """`--layers` copies of the experts' weights, as tensors (the Triton path) and as `Experts` modules."""

    def __init__(self, layers: int, generator: torch.Generator, dtype: torch.dtype):
        device = generator.device
        shapes = (EXPERTS, 2 * INTERMEDIATE, HIDDEN), (EXPERTS, HIDDEN, INTERMEDIATE)
        self.gate_up, self.down = (
            [
                torch.randn(shape, generator=generator, device=device, dtype=dtype) / shape[2] ** 0.5
                for _ in range(layers)
            ]
            for shape in shapes
        )
        self.expert_bytes = (self.gate_up[0][0].numel() + self.down[0][0].numel()) * self.gate_up[0].element_size()
        with torch.device(device):
            self.modules = [Experts(EXPERTS, HIDDEN, INTERMEDIATE) for _ in range(layers)]
        for module, gate_up, down in zip(self.modules, self.gate_up, self.down):
            module.gate_up_proj.data, module.down_proj.data = gate_up, down


def bench_tokens(tokens: int, layers: Layers, configs: dict, generator: torch.Generator, eager_reps: int, replays: int):
    """Every path's row for one batch of `tokens` tokens routed uniformly at random."""
    device, dtype, count = generator.device, layers.gate_up[0].dtype, len(layers.modules)
    x = torch.randn(tokens, HIDDEN, generator=generator, device=device, dtype=dtype)
    indices = torch.rand(tokens, EXPERTS, generator=generator, device=device).topk(TOP_K, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=generator, device=device), dim=-1).to(dtype)
    used = int(expert_counts(indices, EXPERTS).count_nonzero())
    read_bytes = used * layers.expert_bytes + (2 * x.numel() + weights.numel()) * x.element_size() + indices.numel() * 8
    routing = Routing(indices, weights, None)

    def reference(layer: int) -> torch.Tensor:
        with torch.no_grad():
            return layers.modules[layer](x, routing, expert_counts(indices, EXPERTS))

    def row(path: str, config: str, call, versus: str = "-", versus_fp32: str = "-", rated: bool = True) -> None:
        eager = eager_ms(call, count, eager_reps)
        graph = graph_ms(call, count, replays)
        rate = read_bytes / (graph * 1e-3)
        rates = f"{rate / 1e9:>6.0f} {rate / PEAK_BANDWIDTH:>7.1%}" if rated else f"{'-':>6} {'-':>7}"
        times = f"{eager:>9.3f} {graph:>9.3f}"
        print(f"{tokens:>4} {used:>4} {path:<8} {config:<22} {times} {rates} {versus:>8} {versus_fp32:>8}")

    expected = reference(0)
    exact = loop_reference(x, indices, weights, layers.gate_up[0], layers.down[0])
    row("grouped", "F.grouped_mm", reference, "0", f"{(expected.float() - exact).abs().max().item():.2e}")
    for name, config in configs.items():

        def fused(layer: int, config=config) -> torch.Tensor:
            return fused_experts(x, indices, weights, layers.gate_up[layer], layers.down[layer], **config)

        try:
            out = fused(0)
        except Exception as error:  # a config that does not fit (shared memory, registers)
            print(f"{tokens:>4} {used:>4} {'triton':<8} {name:<22} failed: {type(error).__name__}: {error}"[:160])
            continue
        difference = (out.float() - expected.float()).abs().max().item()
        if not difference <= MAX_DIFFERENCE:
            print(f"{tokens:>4} {used:>4} {'triton':<8} {name:<22} DISAGREES with the reference: {difference:.3e}")
        row("triton", name, fused, f"{difference:.2e}", f"{(out.float() - exact).abs().max().item():.2e}")
    block_m = next(iter(configs.values())).get("block_m") or default_block_m(indices.numel(), EXPERTS)
    row("align", f"block_m {block_m}", lambda layer: align_pairs(indices, EXPERTS, block_m), rated=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--layers", type=int, default=4, help="weight copies the calls rotate over (L2-cold)")
    parser.add_argument("--quick", action="store_true", help="two configs, fewer repetitions")
    parser.add_argument("--sweep", action="store_true", help=f"{len(SWEEP)} configs of block sizes, warps, stages")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_experts benchmark: no CUDA device (run it on a machine with an NVIDIA GPU)")
    if not AVAILABLE:
        sys.exit("moe_experts benchmark: triton is not importable (install the CUDA build of torch)")
    configs = SWEEP if args.sweep else dict(list(CONFIGS.items())[:2]) if args.quick else CONFIGS
    eager_reps, replays = (20, 10) if args.quick else (100, 30)

    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    layers = Layers(args.layers, generator, torch.bfloat16)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}: the experts of one layer, H {HIDDEN}, "
        f"I {INTERMEDIATE}, {EXPERTS} experts, top {TOP_K}, bf16, {layers.expert_bytes / 1e6:.2f} MB per expert, "
        f"{args.layers} weight copies"
    )
    columns = ["N", "used", "path", "config", "eager ms", "graph ms", "GB/s", "of peak", "vs ref", "vs fp32"]
    widths = [4, 4, -8, -22, 9, 9, 6, 7, 8, 8]
    print(" ".join(f"{name:<{-width}}" if width < 0 else f"{name:>{width}}" for name, width in zip(columns, widths)))
    for tokens in args.tokens:
        bench_tokens(tokens, layers, configs, generator, eager_reps, replays)


if __name__ == "__main__":
    main()
