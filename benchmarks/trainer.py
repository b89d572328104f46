"""Trainer throughput: `asyncrl trainer --bench` over the issue's cases, with a plain Hugging Face baseline.

    python benchmarks/trainer.py --suite gpu                 # Qwen3-0.6B shape on one GPU (RESULTS.md)
    python benchmarks/trainer.py --suite gpu --nproc 2       # the same, FSDP2 over two GPUs
    python benchmarks/trainer.py --suite cpu                 # tiny and 30M models on the CPU

Every case is a fresh process (`asyncrl trainer --bench`, under torchrun when --nproc > 1), so peak memory
is its own. The GPU suite first checks the document attention kernels against per-document attention in
float32 (`check`), and times one plain Hugging Face step (`hf-16k`: bf16 weights, sdpa with the dense
packed mask, gradient checkpointing, full-vocabulary float32 logits) so the speed-up is measured in the
same run. Prints one table row per case as it finishes, then the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shapes import QWEN3_06B_CONFIG  # benchmarks/, the script's own folder

# name: (seq_len, documents, loss, trainer flags)
GPU_CASES = {
    "rl-16k": (16384, 16, "rl", []),
    "rl-16k-compile": (16384, 16, "rl", ["--perf.compile"]),
    "rl-16k-compile-layer": (16384, 16, "rl", ["--perf.compile", "--perf.fsdp-unit", "layer"]),
    "rl-64k": (65536, 32, "rl", ["--perf.activation-checkpointing", "selective"]),
    "rl-64k-compile": (65536, 32, "rl", ["--perf.activation-checkpointing", "selective", "--perf.compile"]),
    "sft-8k": (8192, 8, "sft", []),
    "sft-8k-compile": (8192, 8, "sft", ["--perf.compile"]),
    "sft-8k-compile-layer": (8192, 8, "sft", ["--perf.compile", "--perf.fsdp-unit", "layer"]),
    "hf-16k": (16384, 16, "rl", None),  # the plain Hugging Face baseline
}
CPU_CASES = {
    "tiny-rl-2k": (2048, 16, "rl", []),
    "tiny-rl-2k-dense": (2048, 16, "rl", ["--perf.attention", "dense"]),
    "30m-rl-2k": (2048, 16, "rl", []),
    "30m-rl-2k-dense": (2048, 16, "rl", ["--perf.attention", "dense"]),
}


def write_shape(folder: Path) -> Path:
    from transformers import Qwen3Config

    Qwen3Config(**QWEN3_06B_CONFIG).save_pretrained(folder)
    return folder


def run_case(name: str, case: tuple, model_dir: Path, args: argparse.Namespace, dtype: str) -> dict | None:
    seq_len, documents, loss, flags = case
    if flags is None:
        command = [sys.executable, __file__, "--worker-hf", str(model_dir), "--seq-len", str(seq_len)]
        command += ["--documents", str(documents), "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps)]
    else:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        command = [sys.executable, *(launcher if args.nproc > 1 else []), "-m", "asyncrl", "trainer", "--bench"]
        command += ["--model.name", str(model_dir), "--model.dtype", dtype, "--seq-len", str(seq_len)]
        command += ["--bench.documents", str(documents), "--bench.loss", loss, "--bench.steps", str(args.steps)]
        command += ["--bench.warmup-steps", str(args.warmup_steps), "--num-threads", str(args.threads), *flags]
    start = time.time()
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        print(f"{name}: no result within {args.timeout} s", flush=True)
        return None
    lines = [line for line in result.stdout.splitlines() if line.startswith("bench-json: ")]
    if result.returncode != 0 or not lines:
        print(
            f"{name}: FAILED (exit {result.returncode})\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}", flush=True
        )
        return None
    row = {"case": name, **json.loads(lines[-1][len("bench-json: ") :]), "wall_s": time.time() - start}
    print(format_row(row), flush=True)
    return row


def format_row(row: dict) -> str:
    mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "n/a"
    settings = (
        "hf baseline" if row["case"].startswith("hf") else f"{row['attention']}, ac {row['activation_checkpointing']}"
    )
    if row.get("compile"):
        settings += ", compile"
    return (
        f"| {row['case']} | {row['seq_len']} = {row['documents']} x {row['seq_len'] // row['documents']} | "
        f"{row['loss']} | {settings} | {row['ranks']} | {row['tokens_per_s']:,.0f} | {mfu} | "
        f"{row['step_time_s']:.3f} | {row.get('cpu_time_s', float('nan')):.3f} | {row['peak_memory_gib']:.1f} |"
    )


def hf_baseline(model_dir: str, seq_len: int, documents: int, steps: int, warmup_steps: int) -> None:
    """A plain Hugging Face step: what one writes without asyncrl's trainer."""
    import statistics

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.config.schema import BenchConfig, TrainerConfig
    from asyncrl.trainer.bench import random_row
    from asyncrl.trainer.logprobs import token_logprobs
    from asyncrl.trainer.perf import peak_flops, training_flops

    device = torch.device("cuda")
    config = AutoConfig.from_pretrained(model_dir)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    cfg = TrainerConfig(seq_len=seq_len, bench=BenchConfig(documents=documents))
    mb = random_row(cfg, config.vocab_size, torch.Generator().manual_seed(0))
    mb = type(mb)(**{k: v.to(device) for k, v in vars(mb).items()})
    times = []
    for step in range(warmup_steps + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False).logits[0]
        logprobs, _ = token_logprobs(logits, mb.input_ids)
        loss = -torch.where(mb.loss_mask, logprobs * mb.advantages, 0.0).sum() / mb.loss_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del logits, logprobs, loss
        torch.cuda.synchronize()
        if step >= warmup_steps:
            times.append(time.perf_counter() - start)
    step_time = statistics.median(times)
    flops = training_flops(model, [seq_len // documents] * documents)
    row = {
        "seq_len": seq_len,
        "documents": documents,
        "loss": "rl",
        "ranks": 1,
        "tokens_per_s": seq_len / step_time,
        "mfu": flops / step_time / peak_flops(device) if peak_flops(device) else None,
        "step_time_s": step_time,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    print("bench-json: " + json.dumps(row), flush=True)


def check_attention() -> None:
    """Document attention on CUDA (varlen flash, and flex with a block mask) against per-document sdpa in
    float32: outputs and gradients, relative error ||x - ref|| / ||ref||."""
    import torch
    import torch.nn.functional as F

    from asyncrl.trainer import attention

    torch.manual_seed(0)
    lengths = [1000, 3, 517, 2048, 528]
    total = sum(lengths)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).cuda()
    q = torch.randn(1, 16, total, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, total, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 8, total, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn(1, total, 16, 128, device="cuda")
    scale = 128**-0.5

    def grads(out):
        q.grad = k.grad = v.grad = None
        (out.float() * upstream).sum().backward()
        return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]

    pieces = [
        F.scaled_dot_product_attention(a.float(), b.float(), c.float(), is_causal=True, scale=scale, enable_gqa=True)
        for a, b, c in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))
    ]
    reference = grads(torch.cat(pieces, 2).transpose(1, 2))
    kernels = {}
    for name in ("varlen", "flex") if attention.VARLEN_ATTN is not None else ("flex",):
        documents = attention.Documents.from_position_ids(position_ids, kernel=name)
        kernels[name] = lambda documents=documents: attention.document_attention(
            None, q, k, v, None, scaling=scale, documents=documents
        )[0]
    for name, kernel in kernels.items():
        errors = [float((x - r).norm() / r.norm()) for x, r in zip(grads(kernel()), reference)]
        print(
            f"check {name}: rel. error out {errors[0]:.1e}, dq {errors[1]:.1e}, dk {errors[2]:.1e}, dv {errors[3]:.1e}"
        )
        for _ in range(3):
            grads(kernel())
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            grads(kernel())
        torch.cuda.synchronize()
        print(f"check {name}: {(time.perf_counter() - start) / 10 * 1e3:.2f} ms fwd+bwd for {total} tokens, 1 layer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--cases", nargs="*", help="subset of the suite's cases, in this order")
    parser.add_argument("--nproc", type=int, default=1, help="trainer ranks (one GPU each)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per case")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads per rank (cpu suite)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one case may take")
    parser.add_argument("--no-check", action="store_true", help="gpu suite: skip the attention check")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON lines here")
    parser.add_argument("--worker-hf", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--documents", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_hf:
        return hf_baseline(args.worker_hf, args.seq_len, args.documents, args.steps, args.warmup_steps)
    if args.worker_check:
        return check_attention()

    header = (
        "| case | seq_len | loss | settings | ranks | tokens/s | MFU | step s | CPU s | peak GiB |\n"
        + "|---" * 10
        + "|"
    )
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        if args.suite == "gpu":
            if not args.no_check:
                subprocess.run([sys.executable, __file__, "--worker-check"], check=False, timeout=args.timeout)
            shape = write_shape(Path(scratch) / "qwen3-0.6b")
            models = {name: shape for name in GPU_CASES}
            cases, dtype = GPU_CASES, "bfloat16"
        else:
            from asyncrl.models import init_model

            for preset in ("tiny", "30m"):
                init_model(Path(scratch) / preset, preset)
            models = {name: Path(scratch) / name.split("-")[0] for name in CPU_CASES}
            cases, dtype = CPU_CASES, "float32"
        print(header, flush=True)
        for name in args.cases or list(cases):
            row = run_case(name, cases[name], models[name], args, dtype)
            if row:
                rows.append(row)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    print("\n" + header)
    for row in rows:
        print(format_row(row))


if __name__ == "__main__":
    main()
