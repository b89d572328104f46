"""Where a GPU decoding step of the native engine goes (Qwen3-0.6B shape, bf16, 128 rows), one GPU:

    python benchmarks/decode_step.py              # engine runs, the captured step, sampler, GEMMs
    python benchmarks/decode_step.py --profile    # and torch.profiler's kernel table of 64 steps

Prints: whole runs of 128 prompts x 128 tokens -> 256 new tokens through the engine (tok/s, and how many
prefills the prompts took: the requests are queued one by one, so the engine may start before the last
arrives); the captured decoding step alone (CUDA graph replay) at three contexts; the sampler on
[128 x 151,936] bf16 logits, Triton kernels against torch (GPU time per call, and host time to launch);
the decoding step's matrix products alone, L2-cold (28 weight copies, as 28 layers), in microseconds and
GB/s of weights read.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from shapes import QWEN3_06B_CONFIG, build_model  # benchmarks/, the script's own folder

ROWS, PROMPT, NEW = 128, 128, 256


def gpu_ms(run: Callable[[], object], calls: int = 100) -> float:
    """Milliseconds per call, by CUDA events around `calls` calls after 5 untimed ones."""
    for _ in range(5):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def engine_runs(engine, runs: int) -> None:
    from asyncrl.inference.engine.engine import GenerationRequest

    prompts = torch.randint(0, 256, (ROWS, PROMPT), generator=torch.Generator().manual_seed(0)).tolist()
    prefill, prefills = engine.runner.prefill, [0]

    def counted(*args, **kwargs):
        prefills[0] += 1
        return prefill(*args, **kwargs)

    engine.runner.prefill = counted

    def one_run(seed: int) -> int:
        futures = [engine.generate(GenerationRequest(p, max_tokens=NEW, seed=seed + i)) for i, p in enumerate(prompts)]
        return sum(len(future.result(600)[0].token_ids) for future in futures)

    one_run(seed=10_000)  # warm-up
    for run in range(runs):
        prefills[0] = 0
        start = time.perf_counter()
        tokens = one_run(seed=run * ROWS)
        elapsed = time.perf_counter() - start
        print(f"engine run {run + 1}: {tokens / elapsed:,.0f} tok/s ({elapsed / NEW * 1e3:.2f} ms per step), "
              f"{prefills[0]} prefill(s)")  # fmt: skip
    engine.runner.prefill = prefill


def captured_step(engine) -> None:
    runner = engine.runner
    for context in (160, 256, 384):
        runner.positions[:ROWS] = context - 1
        ms = gpu_ms(lambda context=context: runner.graphs.run(ROWS, runner._graph_context(context)))
        print(f"captured step, {ROWS} rows, context {context}: {ms:.3f} ms")


def sampler(engine) -> None:
    from asyncrl.inference.engine.engine import GenerationRequest
    from asyncrl.inference.engine.sampling import SamplingBatch, sample

    logits = torch.randn(ROWS, QWEN3_06B_CONFIG["vocab_size"], device="cuda", dtype=torch.bfloat16)
    batch = SamplingBatch.of([GenerationRequest([0], temperature=1.0)] * ROWS, "cuda")
    uniforms = torch.rand(ROWS, dtype=torch.float64, device="cuda")
    for name, kernels in (("Triton kernels", True), ("torch", False)):
        ms = gpu_ms(lambda kernels=kernels: sample(logits, batch, uniforms, kernels).to_host())
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(100):
            sample(logits, batch, uniforms, kernels)
        launch = (time.perf_counter() - start) * 10
        torch.cuda.synchronize()
        print(f"sampler ({name}): {ms:.3f} ms GPU with the copy to the host, {launch:.3f} ms to launch")


def matrix_products() -> None:
    shape = QWEN3_06B_CONFIG
    hidden, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    dim, inner, vocab = shape["head_dim"], shape["intermediate_size"], shape["vocab_size"]
    shapes = {
        "q/k/v": ((heads + 2 * kv_heads) * dim, hidden),
        "o": (hidden, heads * dim),
        "gate/up": (2 * inner, hidden),
        "down": (hidden, inner),
        "LM head": (vocab, hidden),
    }
    for name, (out_features, in_features) in shapes.items():
        copies = 2 if name == "LM head" else 28
        weights = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(ROWS, in_features, device="cuda", dtype=torch.bfloat16)
        for weight in weights:
            F.linear(x, weight)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for weight in weights:
                F.linear(x, weight)
        us = gpu_ms(graph.replay, calls=20) * 1e3 / copies
        gbs = weights[0].numel() * 2 / us / 1e3
        print(
            f"GEMM {name:8s} [{ROWS} x {in_features}] x [{in_features} x {out_features}]: {us:6.1f} us, {gbs:5.0f} GB/s"
        )


def kernel_table(engine) -> None:
    from torch.profiler import ProfilerActivity, profile

    from asyncrl.inference.engine.engine import GenerationRequest

    prompts = torch.randint(0, 256, (ROWS, PROMPT), generator=torch.Generator().manual_seed(1)).tolist()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        futures = [engine.generate(GenerationRequest(p, max_tokens=64, seed=i)) for i, p in enumerate(prompts)]
        [future.result(600) for future in futures]
        torch.cuda.synchronize()
    print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=80))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="timed engine runs")
    parser.add_argument("--profile", action="store_true", help="also print the kernel table of 64 steps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_step.py needs a CUDA GPU")
    from asyncrl.config.schema import InferenceConfig
    from asyncrl.inference.engine.engine import Engine

    folder = Path(tempfile.mkdtemp())
    build_model("qwen3-0.6b", folder, "cuda")
    config = InferenceConfig(
        model={"name": str(folder), "dtype": "bfloat16"}, device="cuda", seq_len=PROMPT + NEW, max_batch_size=ROWS
    )
    engine = Engine(config)
    try:
        engine_runs(engine, args.runs)
        with torch.inference_mode():
            captured_step(engine)
            sampler(engine)
            matrix_products()
        if args.profile:
            kernel_table(engine)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
