"""Trainer throughput: `asyncrl trainer --bench` on prime-rl's published rows and on packed rows.

    python benchmarks/trainer.py --suite like-for-like       # prime-rl's rows on one GPU, then our best settings
    python benchmarks/trainer.py --suite gpu                 # packed rows + a plain Hugging Face baseline
    python benchmarks/trainer.py --suite gpu --nproc 2       # the same, FSDP2 over two GPUs
    python benchmarks/trainer.py --suite cpu                 # tiny and 30M models on the CPU

`like-for-like` runs the rows prime-rl publishes for Qwen3-0.6B (their repository's benchmarks/baselines,
one H100): one document per row (positions 0 .. seq_len - 1), two rows per optimizer step, full activation
recompute: RL at 16,384 and 65,536 tokens, SFT at 8,192. Then the same rows with our best settings (no
recompute where memory allows it). `gpu` runs rows packed from many documents, which document attention
makes far cheaper per token than one document of the same length; it times one plain Hugging Face step
too (`hf-16k`: bf16 weights, sdpa with the dense packed mask, gradient checkpointing, full-vocabulary
float32 logits), so the speed-up is measured in the same run.

Every case is a fresh process (`asyncrl trainer --bench`, under torchrun when --nproc > 1), so peak memory
is its own. The GPU suites first check the attention kernels against float32 attention (`check`: document
attention on a packed row, cuDNN on a one-document row) and time them on one layer. Prints one table row
per case as it finishes, then the table.
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
from typing import NamedTuple

from shapes import QWEN3_06B_CONFIG  # benchmarks/, the script's own folder


class Case(NamedTuple):
    seq_len: int
    documents: int  # equal documents per row
    loss: str  # "rl" | "sft"
    flags: list[str] | None  # `asyncrl trainer` flags; None: the plain Hugging Face baseline
    micro_batches: int = 1  # rows per optimizer step
    warmup_steps: int | None = None  # None: --warmup-steps
    steps: int | None = None  # None: --steps


COMPILE = ["--perf.compile"]
FULL_RECOMPUTE = ["--perf.activation-checkpointing", "full"]
SELECTIVE = ["--perf.activation-checkpointing", "selective"]
# prime-rl's published rows, then ours on the same rows. Their figures (tokens/s, MFU %), mean of their steps:
PRIME_RL = {"rl-16k": (11_896, 11.08), "rl-64k": (10_147, 26.80), "sft-8k": (26_005, 16.81)}
LIKE_FOR_LIKE_CASES = {
    "rl-16k-prime": Case(16384, 1, "rl", FULL_RECOMPUTE + COMPILE, micro_batches=2),
    "rl-64k-prime": Case(65536, 1, "rl", FULL_RECOMPUTE + COMPILE, micro_batches=2, warmup_steps=1, steps=2),
    "sft-8k-prime": Case(8192, 1, "sft", FULL_RECOMPUTE + COMPILE, micro_batches=2),
    "rl-16k-best": Case(16384, 1, "rl", COMPILE, micro_batches=2),
    "rl-64k-best": Case(65536, 1, "rl", COMPILE, micro_batches=2, warmup_steps=1, steps=2),
    # where rl-64k-best runs out of memory: every other layer recomputed
    "rl-64k-selective": Case(65536, 1, "rl", SELECTIVE + COMPILE, micro_batches=2, warmup_steps=1, steps=2),
    "sft-8k-best": Case(8192, 1, "sft", COMPILE, micro_batches=2),
    # the same rows through flash attention: what cuDNN gains
    "rl-64k-flash": Case(65536, 1, "rl", COMPILE + ["--perf.attention-kernel", "flash"], 2, warmup_steps=1, steps=2),
}
GPU_CASES = {
    "rl-16k": Case(16384, 16, "rl", []),
    "rl-16k-compile": Case(16384, 16, "rl", COMPILE),
    "rl-16k-compile-layer": Case(16384, 16, "rl", COMPILE + ["--perf.fsdp-unit", "layer"]),
    "rl-64k": Case(65536, 32, "rl", SELECTIVE),
    "rl-64k-compile": Case(65536, 32, "rl", SELECTIVE + COMPILE),
    "sft-8k": Case(8192, 8, "sft", []),
    "sft-8k-compile": Case(8192, 8, "sft", COMPILE),
    "sft-8k-compile-layer": Case(8192, 8, "sft", COMPILE + ["--perf.fsdp-unit", "layer"]),
    "hf-16k": Case(16384, 16, "rl", None),  # the plain Hugging Face baseline
}
CPU_CASES = {
    "tiny-rl-2k": Case(2048, 16, "rl", []),
    "tiny-rl-2k-dense": Case(2048, 16, "rl", ["--perf.attention", "dense"]),
    "30m-rl-2k": Case(2048, 16, "rl", []),
    "30m-rl-2k-dense": Case(2048, 16, "rl", ["--perf.attention", "dense"]),
}
SUITES = {"like-for-like": LIKE_FOR_LIKE_CASES, "gpu": GPU_CASES, "cpu": CPU_CASES}
DEFAULT_CASES = {"like-for-like": ["rl-16k-prime", "rl-64k-prime", "sft-8k-prime", "rl-16k-best", "rl-64k-best",
                                   "sft-8k-best"]}  # fmt: skip


def write_shape(folder: Path) -> Path:
    from transformers import Qwen3Config

    Qwen3Config(**QWEN3_06B_CONFIG).save_pretrained(folder)
    return folder


def run_case(name: str, case: Case, model_dir: Path, args: argparse.Namespace, dtype: str, timeout: float) -> dict:
    """One case in a fresh process; its bench-json row, or {"case": name, "error": why}."""
    warmup = args.warmup_steps if case.warmup_steps is None else case.warmup_steps
    steps = args.steps if case.steps is None else case.steps
    if case.flags is None:
        command = [sys.executable, __file__, "--worker-hf", str(model_dir), "--seq-len", str(case.seq_len)]
        command += ["--documents", str(case.documents), "--steps", str(steps), "--warmup-steps", str(warmup)]
    else:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        command = [sys.executable, *(launcher if args.nproc > 1 else []), "-m", "asyncrl", "trainer", "--bench"]
        command += ["--model.name", str(model_dir), "--model.dtype", dtype, "--seq-len", str(case.seq_len)]
        command += ["--bench.documents", str(case.documents), "--bench.loss", case.loss]
        command += ["--bench.micro-batches", str(case.micro_batches), "--bench.steps", str(steps)]
        command += ["--bench.warmup-steps", str(warmup), "--num-threads", str(args.threads), *case.flags]
    start = time.time()
    # Fewer allocator splits: long rows otherwise strand memory between differently sized blocks.
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **os.environ, "OMP_NUM_THREADS": "1"}
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"{name}: no result within {timeout:.0f} s", flush=True)
        return {"case": name, "error": f"no result within {timeout:.0f} s"}
    lines = [line for line in result.stdout.splitlines() if line.startswith("bench-json: ")]
    if result.returncode != 0 or not lines:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        print(
            f"{name}: FAILED (exit {result.returncode})\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}", flush=True
        )
        return {"case": name, "error": f"exit {result.returncode}: {tail[:200]}"}
    row = {"case": name, **json.loads(lines[-1][len("bench-json: ") :]), "wall_s": time.time() - start}
    print(format_row(row), flush=True)
    return row


def format_row(row: dict) -> str:
    if "error" in row:
        return f"| {row['case']} | {row['error']} |"
    mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "n/a"
    if row["case"].startswith("hf"):
        settings = "hf baseline"
    else:
        settings = f"{row.get('row_attention_kernel', row['attention'])}, ac {row['activation_checkpointing']}"
    if row.get("compile"):
        settings += ", compile"
    rows = f"{row.get('micro_batches', 1)} x " if row.get("micro_batches", 1) > 1 else ""
    return (
        f"| {row['case']} | {rows}{row['seq_len']} = {row['documents']} x {row['seq_len'] // row['documents']} | "
        f"{row['loss']} | {settings} | {row['ranks']} | {row['tokens_per_s']:,.0f} | {mfu} | "
        f"{row['step_time_s']:.3f} | {row.get('cpu_time_s', float('nan')):.3f} | {row['peak_memory_gib']:.1f} |"
    )


HEADER = (
    "| case | rows/step x seq_len = documents x length | loss | settings | ranks | tokens/s | MFU | step s | CPU s "
    "| peak GiB |\n" + "|---" * 10 + "|"
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
    """The attention kernels on CUDA against float32 attention (outputs and gradients, relative error
    ||x - ref|| / ||ref||): document attention on a packed row (varlen flash, flex with a block mask), and
    one-document rows (cuDNN, varlen flash). Then each one-document kernel's forward + backward speed on one
    layer (16 query / 8 KV heads x 128, bf16), in model FLOPs (perf.py) per second. Ends with a JSON line."""
    import torch
    import torch.nn.functional as F

    from asyncrl.trainer import attention

    torch.manual_seed(0)
    scale = 128**-0.5
    figures = {}

    def row(total: int):
        q = torch.randn(1, 16, total, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 8, total, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, 8, total, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return q, k, v, torch.randn(1, total, 16, 128, device="cuda")

    def grads(out, q, k, v, upstream):
        q.grad = k.grad = v.grad = None
        (out.float() * upstream).sum().backward()
        return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]

    def reference(lengths, q, k, v, upstream):
        pieces = [
            F.scaled_dot_product_attention(
                a.float(), b.float(), c.float(), is_causal=True, scale=scale, enable_gqa=True
            )
            for a, b, c in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))
        ]
        return grads(torch.cat(pieces, 2).transpose(1, 2), q, k, v, upstream)

    def kernel_call(name, lengths, q, k, v):
        position_ids = torch.cat([torch.arange(n) for n in lengths]).cuda()
        documents = attention.Documents.from_position_ids(position_ids, kernel=name)
        return lambda: attention.document_attention(None, q, k, v, None, scaling=scale, documents=documents)[0]

    def check(label, names, lengths):
        q, k, v, upstream = row(sum(lengths))
        exact = reference(lengths, q, k, v, upstream)
        for name in names:
            run = kernel_call(name, lengths, q, k, v)
            errors = [float((x - r).norm() / r.norm()) for x, r in zip(grads(run(), q, k, v, upstream), exact)]
            figures[f"error {label} {name}"] = max(errors)
            print(
                f"check {label}, {name}: rel. error out {errors[0]:.1e}, dq {errors[1]:.1e}, dk {errors[2]:.1e}, "
                f"dv {errors[3]:.1e}",
                flush=True,
            )

    varlen = ["varlen"] if attention.VARLEN_ATTN is not None else []
    check("packed row of 5 documents", [*varlen, "flex"], [1000, 3, 517, 2048, 528])
    check("one document of 8,192", ["cudnn", *varlen], [8192])
    for total in (16384, 65536):
        q, k, v, upstream = row(total)
        flops = 12 * 16 * 128 * total * (total + 1) // 2
        for name in ["cudnn", *varlen]:
            run = kernel_call(name, [total], q, k, v)
            for _ in range(2):
                grads(run(), q, k, v, upstream)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                grads(run(), q, k, v, upstream)
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - start) / 5
            figures[f"tflops {total} {name}"] = flops / seconds / 1e12
            print(
                f"check speed, one document of {total:,}, {name}: {seconds * 1e3:.1f} ms fwd+bwd per layer, "
                f"{flops / seconds / 1e12:.0f} TFLOP/s",
                flush=True,
            )
        del q, k, v, upstream
    print("check-json: " + json.dumps(figures), flush=True)


def run_check(timeout: float) -> dict:
    """`check_attention` in a process of its own; its figures, or {"error": why}."""
    try:
        result = subprocess.run(
            [sys.executable, __file__, "--worker-check"], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s"}
    print(result.stdout, end="", flush=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("check-json: ")]
    if result.returncode != 0 or not lines:
        print(result.stderr[-3000:], flush=True)
        return {"error": f"exit {result.returncode}: {(result.stderr.strip().splitlines() or ['?'])[-1][:200]}"}
    return json.loads(lines[-1][len("check-json: ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=list(SUITES), default="like-for-like")
    parser.add_argument("--cases", nargs="*", help="subset of the suite's cases, in this order")
    parser.add_argument("--nproc", type=int, default=1, help="trainer ranks (one GPU each)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per case")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads per rank (cpu suite)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one case may take")
    parser.add_argument("--no-check", action="store_true", help="GPU suites: skip the attention check")
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

    cases = SUITES[args.suite]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        if args.suite == "cpu":
            from asyncrl.models.offline import init_model

            for preset in ("tiny", "30m"):
                init_model(Path(scratch) / preset, preset)
            models = {name: Path(scratch) / name.split("-")[0] for name in CPU_CASES}
            dtype = "float32"
        else:
            if not args.no_check:
                run_check(args.timeout)
            shape = write_shape(Path(scratch) / "qwen3-0.6b")
            models = {name: shape for name in cases}
            dtype = "bfloat16"
        print(HEADER, flush=True)
        for name in args.cases or DEFAULT_CASES.get(args.suite, list(cases)):
            row = run_case(name, cases[name], models[name], args, dtype, args.timeout)
            rows.append(row)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    print("\n" + HEADER)
    for row in rows:
        print(format_row(row))
    if args.suite == "like-for-like":
        print(
            "\nprime-rl, published (one H100): "
            + ", ".join(f"{k} {v[0]:,} tok/s ({v[1]}%)" for k, v in PRIME_RL.items())
        )


if __name__ == "__main__":
    main()
