"""`asyncrl trainer --bench`: the trainer's own step on random tokens, no orchestrator, and its speed.

The model (ours or transformers', `model.impl`) is built at random from `model.name`'s config.json (no weights
are read, so a folder holding only a config benchmarks any shape), then goes through the very `prepare_model`
/ `parallelize` / step code of `asyncrl trainer` (RL loss) or of SFT's forward (`bench.loss = "sft"`). Each
row is `seq_len` tokens packed from `bench.documents` equal samples. After `bench.warmup_steps` (compilation,
allocator growth) it times `bench.steps` optimizer steps and prints the medians: tokens/s, MFU (perf.py), step
time and peak memory, and, on rank 0, the same as one JSON line for benchmarks/trainer.py. The CPU time of
rank 0's process per step (all its threads) is printed too: on a shared CPU it varies far less than the wall
time.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from asyncrl.config.schema import TrainerConfig
from asyncrl.errors import AsyncRLError
from asyncrl.loading import check_model_name
from asyncrl.models.checkpoint import from_config
from asyncrl.trainer.distributed import World, all_reduce_sum, close_distributed, init_distributed
from asyncrl.trainer.logprobs import compute_logprobs
from asyncrl.trainer.model import clip_grad_norm, fsdp_unit, make_optimizer, parallelize, prepare_model, resolve_impl
from asyncrl.trainer.perf import peak_flops, training_flops
from asyncrl.trainer.rl import counts_rows, data_rank, train_step
from asyncrl.transport.rollouts import MicroBatch


def random_row(cfg: TrainerConfig, vocab_size: int, generator: torch.Generator) -> MicroBatch:
    """One packed row of `bench.documents` equal samples; every token but each sample's first is a loss token."""
    length = cfg.seq_len // cfg.bench.documents
    position_ids = torch.arange(length).repeat(cfg.bench.documents)
    loss_mask = position_ids > 0
    advantages = torch.randn(cfg.bench.documents, generator=generator).repeat_interleave(length)
    return MicroBatch(
        input_ids=torch.randint(0, vocab_size, (cfg.seq_len,), generator=generator),
        position_ids=position_ids,
        loss_mask=loss_mask,
        advantages=advantages * loss_mask,
        inference_logprobs=-torch.rand(cfg.seq_len, generator=generator) * 10 * loss_mask,
        temperature=torch.ones(cfg.seq_len),
        sample_lengths=torch.full((cfg.bench.documents,), length),
    )


def sft_step(model: torch.nn.Module, micro_batches: list[MicroBatch], cfg: TrainerConfig, world: World) -> None:
    """SFT's forward and loss: -log p of the loss tokens over their global count."""
    local = sum(int(mb.loss_mask.sum()) for mb in micro_batches) * int(counts_rows(model))
    total = int(all_reduce_sum(torch.tensor([local]).to(world.device)))
    for mb in micro_batches:
        input_ids, mask = mb.input_ids.to(world.device), mb.loss_mask.to(world.device)
        logprobs, _ = compute_logprobs(
            model,
            input_ids,
            mb.position_ids.to(world.device),
            chunk_size=cfg.perf.logprob_chunk_size,
            with_entropy=False,
            compiled=cfg.perf.compile,
        )
        (-torch.where(mask, logprobs, 0.0).sum() / total).backward()


def peak_memory_gib(device: torch.device) -> tuple[str, float]:
    if device.type == "cuda":
        return "peak allocated", torch.cuda.max_memory_allocated(device) / 2**30
    return "peak RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux


def profile_steps(one_step, folder: Path, world: World, steps: int = 2) -> None:
    """`steps` more steps under torch.profiler: a Chrome trace per rank in `folder`; rank 0 prints the kernels
    (and CPU ops) that took the most time, per step, and writes the table beside the traces."""
    from torch.profiler import ProfilerActivity, profile

    folder.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if world.device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as profiler:
        for _ in range(steps):
            one_step()
    trace = folder / f"trace_rank{world.rank}.json"
    profiler.export_chrome_trace(str(trace))
    if world.is_main:
        sort_by = "self_device_time_total" if world.device.type == "cuda" else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=90)
        (folder / "kernels.txt").write_text(table)
        print(f"bench: profile of {steps} steps: {trace} (Chrome trace), {folder / 'kernels.txt'}\n{table}", flush=True)


def run_bench(cfg: TrainerConfig) -> int:
    if cfg.seq_len % cfg.bench.documents:
        raise AsyncRLError(
            f"seq_len {cfg.seq_len} is not a multiple of bench.documents {cfg.bench.documents} "
            "(the benchmark packs equal samples)"
        )
    check_model_name(cfg.model.name)
    world = init_distributed(cfg.device, cfg.num_threads, cfg.seed)
    try:
        config = AutoConfig.from_pretrained(cfg.model.name)
        impl = resolve_impl(cfg.model, cfg.perf, config)
        if impl == "native":
            model = from_config(config, world.device, torch.float32)
        else:
            with world.device:
                model = AutoModelForCausalLM.from_config(
                    config, dtype=torch.float32, attn_implementation=cfg.model.attn_implementation
                )
        model = prepare_model(model, cfg.perf)
        document_lengths = [cfg.seq_len // cfg.bench.documents] * cfg.bench.documents
        kernel = model.attention_kernels.for_row(document_lengths) if cfg.perf.attention == "document" else "dense"
        data_ranks = cfg.rollout_files(world.world_size)  # a context-parallel group trains one rank's rows
        step_flops = training_flops(model, document_lengths) * cfg.bench.micro_batches * data_ranks
        parameters = sum(p.numel() for p in model.parameters())
        model = parallelize(model, world.world_size, world.device, cfg.model.dtype, cfg.perf, cfg.ep, cfg.cp)
        optimizer = make_optimizer(model, cfg.optim)
        generator = torch.Generator().manual_seed(cfg.seed + data_rank(world.rank, cfg.cp))
        micro_batches = [random_row(cfg, config.vocab_size, generator) for _ in range(cfg.bench.micro_batches)]
        step_tokens = cfg.seq_len * cfg.bench.micro_batches * data_ranks

        def one_step() -> None:
            if cfg.bench.loss == "rl":
                train_step(model, micro_batches, cfg, world)
            else:
                sft_step(model, micro_batches, cfg, world)
            clip_grad_norm(model, cfg.optim.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if world.device.type == "cuda":
                torch.cuda.synchronize(world.device)

        times, cpu_times = [], []
        for step in range(cfg.bench.warmup_steps + cfg.bench.steps):
            if world.device.type == "cuda":
                torch.cuda.synchronize(world.device)
            start, cpu_start = time.perf_counter(), time.process_time()
            one_step()
            if step >= cfg.bench.warmup_steps:
                times.append(time.perf_counter() - start)
                cpu_times.append(time.process_time() - cpu_start)

        step_time = statistics.median(times)
        peak = peak_flops(world.device)
        memory_name, memory = peak_memory_gib(world.device)
        result = {
            "model": cfg.model.name,
            "impl": impl,
            "parameters": parameters,
            "loss": cfg.bench.loss,
            "seq_len": cfg.seq_len,
            "documents": cfg.bench.documents,
            "micro_batches": cfg.bench.micro_batches,
            "ranks": world.world_size,
            "device": torch.cuda.get_device_name(world.device) if world.device.type == "cuda" else "cpu",
            "dtype": cfg.model.dtype,
            **cfg.perf.model_dump(),
            "fsdp_unit": fsdp_unit(world.world_size, cfg.perf),  # "auto" resolved
            "row_attention_kernel": kernel,  # what perf.attention_kernel runs these rows with
            "tokens_per_s": step_tokens / step_time,
            "mfu": step_flops / step_time / (peak * world.world_size) if peak else None,
            "step_time_s": step_time,
            "cpu_time_s": statistics.median(cpu_times),
            "peak_memory_gib": memory,
            "steps": len(times),
        }
        if world.is_main:
            mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "n/a (unknown peak)"
            print(
                f"bench: {cfg.bench.loss} loss, {world.world_size} rank(s) on {result['device']}, {impl} model, "
                f"{parameters / 1e6:.1f}M parameters, seq_len {cfg.seq_len} = {cfg.bench.documents} x "
                f"{document_lengths[0]}, {cfg.bench.micro_batches} row(s)/rank/step, attention kernel {kernel}\n"
                f"bench: {result['tokens_per_s']:.0f} tokens/s | MFU {mfu} | step {step_time:.3f} s | "
                f"{memory_name} {memory:.2f} GiB (rank 0) | CPU time {result['cpu_time_s']:.3f} s (rank 0) | "
                f"median of {len(times)} steps after "
                f"{cfg.bench.warmup_steps} warm-up",
                flush=True,
            )
            print("bench-json: " + json.dumps(result), flush=True)
        if cfg.bench.profile is not None:
            profile_steps(one_step, cfg.bench.profile, world)
        return 0
    finally:
        close_distributed()
