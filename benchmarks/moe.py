"""Mixture-of-experts on one GPU, at the Qwen3-30B-A3B shape (random weights, bf16), against transformers' own
Qwen3-MoE (its grouped-GEMM experts) in the same run. Each part runs in a fresh process (its peak memory is
its own); the results print as one table and, with --out, as moe.json.

    python benchmarks/moe.py trainer [--layers 8] [--seq-lens 16384 65536]
    python benchmarks/moe.py engine  [--layers 48] [--prompts 128] [--new-tokens 256]
    python benchmarks/moe.py replay  [--layers 8]
    python benchmarks/moe.py all --out DIR
    python benchmarks/moe.py all --smoke            # the script itself, on a tiny shape on the CPU

- trainer: `asyncrl trainer --bench` (RL loss, one document per row, optimizer step included) on the shape cut
  to `--layers` layers, with activation recompute off and full, compiled; against a plain transformers step
  with the same recompute (bf16 weights, gradient checkpointing for "full", sdpa, full-vocabulary logits
  and cross entropy, forward + backward, no optimizer). MFU on active parameters, the same formula for both
  (trainer/perf.py).
- engine: the native engine (`inference.load_format = "dummy"`) decoding `--prompts` prompts of 128 random
  tokens x `--new-tokens` new tokens each (sampling at temperature 1, EOS ignored), median of the timed runs,
  against a warm transformers `generate` of the same prompts x 64 new tokens (greedy), and the memory-
  bandwidth bound of the engine's run: every decoding step reads every weight but the input embedding once
  (at batch 128 with top 8 of 128 experts, every expert is hit) and every running sample's keys and values,
  at 3.4 TB/s (the best any kernel of ours read on an H200) and at 4.0 TB/s.
- replay: the engine and the trainer (bf16 FSDP2 over float32 master weights) on the same weights: the engine
  samples with routing recorded, the trainer recomputes the logprobs without and with router replay:
  mismatch_kl (mean exp(r) - r - 1 over the sampled tokens) both ways, and the share of (token, layer) where
  the two sides chose other experts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from inference import bandwidth_bound  # benchmarks/, the script's own folder
from shapes import moe_shape_folder
from transformers import AutoConfig

BANDWIDTHS = {"3.4 TB/s": 3.4e12, "4.0 TB/s": 4.0e12}
# --smoke: a tiny shape on the CPU, to run the script's every path without a GPU
SMOKE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
             num_experts=8, num_experts_per_tok=2, vocab_size=300)  # fmt: skip
DEVICE = os.environ.get("MOE_BENCH_DEVICE", "cuda")


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else float("nan")


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run_worker(args: list[str], timeout: float) -> dict:
    """A worker in a fresh process; its last `moe-json:` line, or {"error": why}."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **os.environ, "OMP_NUM_THREADS": "4"}
    try:
        result = subprocess.run(
            [sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s"}
    lines = [line for line in result.stdout.splitlines() if line.startswith("moe-json: ")]
    if result.returncode != 0 or not lines:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-12:])
        return {"error": f"exit {result.returncode}: {tail[-1500:]}"}
    return json.loads(lines[-1][len("moe-json: ") :])


def run_ours_train(folder: Path, seq_len: int, checkpointing: str, timeout: float, profile: Path | None) -> dict:
    command = [sys.executable, "-m", "asyncrl", "trainer", "--bench", "--model.name", str(folder)]
    if profile is not None:
        command += ["--bench.profile", str(profile)]
    command += ["--model.dtype", "bfloat16", "--seq-len", str(seq_len), "--bench.documents", "1", "--perf.compile"]
    command += ["--perf.activation-checkpointing", checkpointing, "--bench.steps", "4", "--bench.warmup-steps", "3"]
    if DEVICE == "cpu":
        command += ["--device", "cpu", "--model.dtype", "float32"]
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **os.environ, "OMP_NUM_THREADS": "4"}
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s"}
    lines = [line for line in result.stdout.splitlines() if line.startswith("bench-json: ")]
    if result.returncode != 0 or not lines:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-6:])
        return {"error": f"exit {result.returncode}: {tail[-800:]}"}
    row = json.loads(lines[-1][len("bench-json: ") :])
    return {key: row[key] for key in ("tokens_per_s", "mfu", "step_time_s", "peak_memory_gib", "parameters", "impl")}


def hf_train(folder: str, seq_len: int, checkpointing: bool, steps: int = 4, warmup: int = 2) -> dict:
    from transformers import AutoModelForCausalLM

    from asyncrl.trainer.perf import peak_flops, training_flops

    device = torch.device(DEVICE)
    config = AutoConfig.from_pretrained(folder)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(
        0, config.vocab_size, (1, seq_len), device=device, generator=torch.Generator(device).manual_seed(0)
    )
    times = []
    for step in range(warmup + steps):
        synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        del loss
        synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    step_time = statistics.median(times)
    peak = peak_flops(device)
    return {
        "tokens_per_s": seq_len / step_time,
        "mfu": training_flops(model, [seq_len]) / step_time / peak if peak else None,
        "step_time_s": step_time,
        "peak_memory_gib": peak_gib(),
    }


def prompts_of(count: int, length: int = 128) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (length,), generator=generator).tolist() for _ in range(count)]


def engine_config(
    folder: str, slots: int, seq_len: int, moe_kernel: str = "auto", dtype: str | None = None, load_format="dummy"
):
    from asyncrl.config.schema import InferenceConfig

    config = AutoConfig.from_pretrained(folder)
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    return InferenceConfig(
        model={"name": folder, "dtype": dtype or ("bfloat16" if DEVICE == "cuda" else "float32")},
        load_format=load_format,
        device=DEVICE,
        seq_len=seq_len,
        max_batch_size=slots,
        kv_cache_gb=slots * seq_len * token_bytes / 2**30 * 1.05,
        moe_kernel=moe_kernel,
    )


def engine_run(folder: str, prompts: int, new_tokens: int, moe_kernel: str, repeats: int) -> dict:
    from asyncrl.inference.engine.engine import Engine, GenerationRequest

    start = time.perf_counter()
    engine = Engine(engine_config(folder, prompts, 128 + new_tokens + 8, moe_kernel))
    ready = time.perf_counter() - start
    batch = prompts_of(prompts)

    def one_run(tokens: int, seed: int) -> float:
        begin = time.perf_counter()
        futures = [
            engine.generate(GenerationRequest(p, max_tokens=tokens, seed=seed + i, ignore_eos=True))
            for i, p in enumerate(batch)
        ]
        generated = sum(len(c.token_ids) for f in futures for c in f.result(600))
        return generated / (time.perf_counter() - begin)

    one_run(16, 0)  # first prefills and the sampler's first batch shapes
    rates = [one_run(new_tokens, 100 * (r + 1)) for r in range(repeats)]
    model = engine.model
    embedding = model.get_input_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)
    config = model.config
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * embedding.element_size()
    bounds = {
        name: bandwidth_bound([128] * prompts, [[new_tokens]] * prompts, prompts, weight_bytes, kv_bytes, bw, False)
        for name, bw in BANDWIDTHS.items()
    }
    engine.stop()
    return {
        "tokens_per_s": statistics.median(rates),
        "runs": rates,
        "ready_s": ready,
        "weight_gb": weight_bytes / 1e9,
        "bound_tokens_per_s": bounds,
        "moe_kernel": engine.runner.moe_kernel,
        "peak_memory_gib": peak_gib(),
    }


def hf_generate(folder: str, prompts: int, new_tokens: int = 64) -> dict:
    from transformers import AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    ids = torch.tensor(prompts_of(prompts), device=DEVICE)

    def one_run() -> float:
        synchronize()
        begin = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        synchronize()
        return (out.shape[1] - ids.shape[1]) * prompts / (time.perf_counter() - begin)

    one_run()  # warm, at full length
    return {"tokens_per_s": one_run(), "new_tokens": new_tokens, "peak_memory_gib": peak_gib()}


def replay(folder: str, dtype: str, load_format: str, prompts: int = 64, new_tokens: int = 128) -> dict:
    from asyncrl.config.schema import PerfConfig
    from asyncrl.inference.engine.engine import Engine, GenerationRequest
    from asyncrl.models.checkpoint import from_config
    from asyncrl.trainer.distributed import init_distributed
    from asyncrl.trainer.logprobs import row_logprobs
    from asyncrl.trainer.model import parallelize, prepare_model

    engine = Engine(engine_config(folder, prompts, 128 + new_tokens + 8, dtype=dtype, load_format=load_format))
    batch = prompts_of(prompts)
    futures = [
        engine.generate(
            GenerationRequest(p, max_tokens=new_tokens, seed=i, ignore_eos=True, return_routed_experts=True)
        )
        for i, p in enumerate(batch)
    ]
    samples = [(p, f.result(600)[0]) for p, f in zip(batch, futures)]
    state = {name: tensor.float() for name, tensor in engine.model.state_dict().items()}
    engine.stop()
    del engine
    world = init_distributed(DEVICE, 4, 0)
    model = from_config(AutoConfig.from_pretrained(folder), world.device, torch.float32)
    model.load_state_dict(state)
    del state
    perf = PerfConfig()
    model = parallelize(prepare_model(model, perf), 1, world.device, dtype, perf)
    chosen: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out: chosen.append(out.indices))
    sums = {"plain": [0.0, 0], "replay": [0.0, 0]}
    differ, pairs = 0, 0
    with torch.no_grad():
        for prompt, sample in samples:
            ids = torch.tensor(prompt + sample.token_ids, device=world.device)
            positions = torch.arange(len(ids), device=world.device)
            recorded = torch.from_numpy(np.concatenate([sample.prompt_routed_experts, sample.routed_experts]))
            recorded = recorded.to(world.device)
            inference = torch.tensor(sample.logprobs, device=world.device)
            for mode, routed in (("plain", None), ("replay", recorded)):
                chosen.clear()
                lp = row_logprobs(model, ids, positions, routed_experts=routed).logprobs[len(prompt) :]
                r = lp - inference
                sums[mode][0] += float((r.exp() - r - 1).sum())
                sums[mode][1] += r.numel()
                if mode == "plain":
                    own = torch.stack(chosen, dim=1)[:-1].sort(dim=-1).values
                    differ += int((own != recorded[:-1].long().sort(dim=-1).values).any(dim=-1).sum())
                    pairs += own.shape[0] * own.shape[1]
    return {
        "samples": len(samples),
        "mismatch_kl": {mode: total / max(count, 1) for mode, (total, count) in sums.items()},
        "routing_differs": differ / max(pairs, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["trainer", "engine", "replay", "all"], nargs="+")
    parser.add_argument("--layers", type=int, default=None, help="default: 8 (trainer, replay), 48 (engine)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=400, help="seconds each part may take")
    parser.add_argument("--kernels", nargs="+", default=["triton", "grouped_mm"], help="engine: inference.moe_kernel")
    parser.add_argument("--checkpointing", nargs="+", default=["off", "full"], help="trainer rows up to 16,384")
    parser.add_argument("--skip-transformers", action="store_true", help="our parts only")
    parser.add_argument("--profile", type=Path, default=None, help="trainer: a torch.profiler trace of ours per row")
    parser.add_argument("--replay-model", type=Path, default=None, help="replay: a model folder with weights")
    parser.add_argument("--replay-dtype", default="bfloat16", help="replay: engine and trainer compute dtype")
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny shape on the CPU: checks the script, measures nothing"
    )
    args = parser.parse_args()
    shape = SMOKE if args.smoke else {}
    if args.smoke:
        os.environ["MOE_BENCH_DEVICE"] = "cpu"
        globals()["DEVICE"] = "cpu"
        args.seq_lens, args.prompts, args.new_tokens = [256], 8, 16
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if {"trainer", "all"} & set(args.part):
            folder = moe_shape_folder(Path(tmp) / "train", args.layers or (2 if args.smoke else 8), **shape)
            for seq_len in args.seq_lens:
                for checkpointing in args.checkpointing if seq_len <= 16384 else ("full",):
                    key = f"trainer {seq_len} ours ac={checkpointing}"
                    profile = args.profile / f"{seq_len}_ac_{checkpointing}" if args.profile else None
                    results[key] = run_ours_train(folder, seq_len, checkpointing, args.timeout, profile)
                    print(key, results[key], flush=True)
                    if not args.skip_transformers:
                        key = f"trainer {seq_len} transformers ac={checkpointing}"
                        command = ["--worker", "hf-train", str(folder), str(seq_len), checkpointing]
                        results[key] = run_worker(command, args.timeout)
                        print(key, results[key], flush=True)
        if {"engine", "all"} & set(args.part):
            folder = moe_shape_folder(Path(tmp) / "engine", args.layers or (2 if args.smoke else 48), **shape)
            common = [str(folder), str(args.prompts), str(args.new_tokens)]
            for kernel in args.kernels if not args.smoke else ["grouped_mm"]:
                repeats = 3 if kernel == args.kernels[0] else 1
                key = f"engine ours {kernel}"
                results[key] = run_worker(["--worker", "engine", *common, kernel, str(repeats)], args.timeout)
                print(key, results[key], flush=True)
            if not args.skip_transformers:
                results["engine transformers"] = run_worker(["--worker", "hf-generate", *common], args.timeout)
                print("engine transformers", results["engine transformers"], flush=True)
        if {"replay", "all"} & set(args.part):
            folder = args.replay_model or moe_shape_folder(
                Path(tmp) / "replay", args.layers or (2 if args.smoke else 8), **shape
            )
            load = "auto" if args.replay_model else "dummy"
            results["replay"] = run_worker(["--worker", "replay", str(folder), args.replay_dtype, load], args.timeout)
            print("replay", results["replay"], flush=True)
    print_table(results)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe.json").write_text(json.dumps(results, indent=2))


def print_table(results: dict) -> None:
    print("\n| part | tokens/s | MFU | step s | peak GiB | note |\n|---|---|---|---|---|---|")
    for key, row in results.items():
        if "error" in row:
            print(f"| {key} | error | | | | {row['error'].splitlines()[-1][:120]} |")
        elif key.startswith("trainer"):
            mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "n/a"
            theirs = results.get(key.replace(" ours ", " transformers "), {})
            ratio = (
                f"{row['tokens_per_s'] / theirs['tokens_per_s']:.2f}x transformers"
                if " ours " in key and "tokens_per_s" in theirs
                else ""
            )
            print(f"| {key} | {row['tokens_per_s']:,.0f} | {mfu} | {row['step_time_s']:.3f} | "
                  f"{row['peak_memory_gib']:.1f} | {ratio} |")  # fmt: skip
        elif key.startswith("engine ours"):
            bounds = ", ".join(
                f"{v:,.0f} at {k} ({row['tokens_per_s'] / v:.0%})" for k, v in row["bound_tokens_per_s"].items()
            )
            print(f"| {key} | {row['tokens_per_s']:,.0f} | | | {row['peak_memory_gib']:.1f} | bound {bounds} |")
        elif key == "engine transformers":
            print(
                f"| {key} | {row['tokens_per_s']:,.0f} | | | {row['peak_memory_gib']:.1f} | {row['new_tokens']} new |"
            )
        elif key == "replay":
            kl = row["mismatch_kl"]
            print(f"| replay | | | | | mismatch_kl {kl['plain']:.2e} -> {kl['replay']:.2e} with replay; "
                  f"routing differs on {row['routing_differs']:.2%} of (token, layer) |")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        kind, rest = sys.argv[2], sys.argv[3:]
        workers = {
            "hf-train": lambda: hf_train(rest[0], int(rest[1]), rest[2] != "off"),
            "engine": lambda: engine_run(rest[0], int(rest[1]), int(rest[2]), rest[3], int(rest[4])),
            "hf-generate": lambda: hf_generate(rest[0], int(rest[1])),
            "replay": lambda: replay(rest[0], rest[1], rest[2]),
        }
        print("moe-json: " + json.dumps(workers[kind]()), flush=True)
    else:
        main()
