"""`asyncrl trainer`: the RL train loop, one process per rank (torchrun), FSDP2 over the ranks.

    for step n = 1, 2, ...            (with --resume: from the checkpoint's step + 1, docs/checkpoints.md)
        wait for rollouts/step_n/rank_R  →  count the loss tokens of all ranks (N)
                                          (R: the rank's context-parallel group, `data_rank`)
        for each micro-batch: forward → logprobs → loss / N → backward
        clip → AdamW step  →  publish weights/step_n (rank 0)  →  delete the rollouts  →  log
        every ckpt.interval steps: checkpoints/step_n/trainer

The trainer is algorithm-blind: advantages, masks and inference logprobs arrive as per-token streams.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from asyncrl import checkpoints
from asyncrl.config.schema import TrainerConfig
from asyncrl.errors import AsyncRLError
from asyncrl.loading import DTYPES, load_tokenizer
from asyncrl.metrics import MetricsLogger
from asyncrl.models.checkpoint import checkpoint_state_dict
from asyncrl.progress import timed
from asyncrl.step_profiler import StepProfiler
from asyncrl.trainer import checkpoint
from asyncrl.trainer.checkpoint import TrainerProgress
from asyncrl.trainer.distributed import World, all_reduce_sum, check_same_count, close_distributed, init_distributed
from asyncrl.trainer.logprobs import RowLogprobs, row_logprobs
from asyncrl.trainer.lora import adapter_config, adapter_state_dict, is_lora
from asyncrl.trainer.loss import LossInputs, rl_loss
from asyncrl.trainer.model import (
    apart_from,
    clip_grad_norm,
    full_state_dict,
    make_optimizer,
    parallelize,
    set_learning_rate,
    setup_model,
)
from asyncrl.trainer.routing import RoutingMetrics, balance_loss
from asyncrl.trainer.schedule import learning_rate
from asyncrl.transport import weights
from asyncrl.transport.rollouts import MicroBatch, rank_file, step_dir, wait_for_batch
from asyncrl.transport.transfer import FolderPublisher, make_publisher

# Per-token sums reduced over ranks, then divided by the global loss-token count N.
TOKEN_MEANS = ("entropy", "mismatch_kl", "masked/low", "masked/high")


def check_micro_batch(mb: MicroBatch, path: Path) -> None:
    if bool((mb.loss_mask.bool() & (mb.position_ids == 0)).any()):
        raise AsyncRLError(
            f"{path}: a loss token sits at position 0 of a sample, where no logits predict it "
            "(the orchestrator must mask the first token of every packed sample)"
        )


def compute_loss(
    model: torch.nn.Module, mb: MicroBatch, totals: tuple[int, int], cfg: TrainerConfig, device: torch.device
) -> tuple[torch.Tensor, dict[str, torch.Tensor], RowLogprobs]:
    """Forward one packed row and return its share of the step loss, per-token sums for metrics (with "loss":
    what this rank adds to the step's loss metric), and its logprobs (with the routing summaries of a
    mixture-of-experts model). `totals`: the step's loss tokens and tokens, all ranks."""
    mb = MicroBatch(**{name: t.to(device) for name, t in vars(mb).items() if t is not None})
    total_loss_tokens, total_tokens = totals
    replay = mb.routed_experts if cfg.loss.router_replay else None
    row = row_logprobs(
        model,
        mb.input_ids,
        mb.position_ids,
        mb.temperature,
        cfg.perf.logprob_chunk_size,
        compiled=cfg.perf.compile,
        routed_experts=replay,
    )
    inputs = LossInputs(
        row.logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask, mb.position_ids, total_loss_tokens
    )
    loss, sums = rl_loss(inputs, cfg.loss)
    sums["entropy"] = torch.where(mb.loss_mask.bool(), row.entropy, 0.0).sum()
    sums["loss"] = loss.detach()
    if not counts_rows(model):
        sums = {name: torch.zeros_like(value) for name, value in sums.items()}
    if row.routing is not None:
        aux = balance_loss(row.routing, cfg.loss.router_aux_coef, total_tokens)
        loss = loss + aux
        sums["loss"] = sums["loss"] + (aux.detach() if isinstance(aux, torch.Tensor) else aux)
    return loss, sums, row


def counts_rows(model: torch.nn.Module) -> bool:
    """Whether this rank's rows count in the step's token counts and metrics. The ranks of a context-parallel
    group hold the same rows and each computes their whole loss (its gradient flows through its own slice
    only): they count once, on the group's first rank. So do the rows' routing summaries, which the group sums
    over its slices; each rank adds its own slice's share of the balancing loss (trainer/routing.py)."""
    cp = getattr(model, "context_parallel", None)
    return cp is None or cp.rank == 0


def data_rank(rank: int, cp: int) -> int:
    """The rollout file a trainer rank reads: one per context-parallel group (consecutive ranks, `device_meshes`)."""
    return rank // cp


def check_router_replay(micro_batches: list[MicroBatch], cfg: TrainerConfig, path: Path) -> None:
    if cfg.loss.router_replay and any(mb.routed_experts is None for mb in micro_batches if mb.loss_mask.any()):
        raise AsyncRLError(
            f"{path}: loss.router_replay is on but these rollouts carry no routed experts (the native inference "
            "engine records them for mixture-of-experts models when the orchestrator asks; vLLM does not)"
        )


def train_step(
    model: torch.nn.Module, micro_batches: list[MicroBatch], cfg: TrainerConfig, world: World
) -> dict[str, float]:
    """Accumulate gradients over this rank's micro-batches; returns the step's metrics over all ranks."""
    local = torch.tensor(
        [sum(int(mb.loss_mask.sum()) for mb in micro_batches), sum(mb.num_tokens for mb in micro_batches)],
        device=world.device,
    ) * int(counts_rows(model))
    total_loss_tokens, total_tokens = (int(v) for v in all_reduce_sum(local))
    sums = torch.zeros(1 + len(TOKEN_MEANS), device=world.device)
    routing = RoutingMetrics(model, world.device)
    for mb in micro_batches:
        loss, token_sums, row = compute_loss(model, mb, (total_loss_tokens, total_tokens), cfg, world.device)
        loss.backward()
        sums += torch.stack([token_sums[name] for name in ("loss", *TOKEN_MEANS)])
        if counts_rows(model):
            routing.add(row.routing)
    sums = all_reduce_sum(sums).tolist()
    metrics = {"loss": sums[0]}
    metrics.update({name: value / max(total_loss_tokens, 1) for name, value in zip(TOKEN_MEANS, sums[1:])})
    metrics.update(routing.metrics())
    metrics["tokens"] = total_tokens
    return metrics


class PublishSeconds(NamedTuple):
    gather: float  # gathering the full tensors, all ranks
    write: float  # waiting for the previous version's write, then handing this one over (rank 0)


def publish_weights(
    model: torch.nn.Module, tokenizer, cfg: TrainerConfig, step: int, world: World, publisher: FolderPublisher
) -> PublishSeconds:
    """Publish policy version `step`: the whole model, or with LoRA only the adapter, by the run's weight
    transfer (transport/transfer.py). A collective: every rank takes part in gathering the tensors; rank 0
    sends them, or hands them to the publisher's background write and returns."""
    start = time.perf_counter()
    publisher.wait()  # the last version is on disk before this one is gathered: host memory holds one copy
    gather_start = time.perf_counter()
    lora = is_lora(model)
    on_device = not lora and publisher.gather_on_device and world.device.type == "cuda"
    if lora:
        state_dict = adapter_state_dict(model)
    elif on_device:
        # Gathered on the GPU, not through host memory: the sender broadcasts from there.
        state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        torch.cuda.synchronize(world.device)  # the gather's time, not the broadcast's
    else:
        state_dict = full_state_dict(model)
    gathered = time.perf_counter()
    if world.is_main:
        if not lora:  # the Hugging Face checkpoint layout (one matrix per expert), as every reader expects
            state_dict = checkpoint_state_dict(model.config, state_dict)
        if not on_device:  # the folder is written in the background while the next step changes the model
            state_dict = apart_from(model, state_dict)
        adapter = adapter_config(model) if lora else None
        publisher.publish(step, state_dict, model.config, tokenizer, adapter, last=step == cfg.max_steps)
    return PublishSeconds(gathered - gather_start, (gather_start - start) + (time.perf_counter() - gathered))


def train(cfg: TrainerConfig) -> int:
    world = init_distributed(cfg.device, cfg.num_threads, cfg.seed)
    try:
        with timed(f"trainer: loading {cfg.model.name}", shown=world.is_main):
            model = setup_model(cfg.model, world.device, cfg.perf)
            if cfg.loss.router_replay and not getattr(model, "moe_layers", None):
                raise AsyncRLError(
                    "loss.router_replay replays the experts a mixture-of-experts model routed each token to: it "
                    "needs such a model and model.impl = 'native'"
                )
            model = parallelize(model, world.world_size, world.device, cfg.model.dtype, cfg.perf, cfg.ep, cfg.cp)
        optimizer = make_optimizer(model, cfg.optim)
        tokenizer = load_tokenizer(cfg.model.name)  # published weights carry it, so each is a whole model
        # Broadcast: rank 0 opens the group and waits here until every inference server has joined.
        publisher = make_publisher(
            cfg.weight_transfer, cfg.output_dir, world.device, DTYPES[cfg.model.dtype], world.is_main, cfg.keep_weights
        )
        done = 0  # steps finished before this process started
        if cfg.resume is not None:
            with timed("trainer: loading the checkpoint", shown=world.is_main):
                resumed = checkpoint.resume(
                    cfg.output_dir, checkpoints.RL_PARTS, cfg.resume.step, model, optimizer, world
                )
            done = resumed.step
            # The off-policy bound needs policy version `done`, which weight pruning may have deleted from disk;
            # a broadcast reaches only the inference servers of this run, which started on the base model.
            published = (weights.weights_dir(cfg.output_dir, done) / weights.MARKER).exists()
            if publisher.resend_on_resume or not published:
                publish_weights(model, tokenizer, cfg, done, world, publisher)
        logger = MetricsLogger(cfg.output_dir, "trainer") if world.is_main else None
        if world.is_main:
            print(
                f"trainer: {world.world_size} rank(s) on {world.device}, model {cfg.model.name}, "
                f"steps {done + 1}..{cfg.max_steps}",
                flush=True,
            )

        save_seconds = None  # the last checkpoint save's time: the next one's ETA
        profiler = StepProfiler(cfg.profile, f"trainer_rank_{world.rank}", world.device.type)
        for step in range(done + 1, cfg.max_steps + 1):
            step_start = time.time()
            rollouts = data_rank(world.rank, cfg.cp)
            micro_batches = wait_for_batch(cfg.output_dir, step, rollouts, cfg.wait_timeout)
            train_start = time.time()
            for mb in micro_batches:
                check_micro_batch(mb, rank_file(cfg.output_dir, step, rollouts))
            check_router_replay(micro_batches, cfg, rank_file(cfg.output_dir, step, rollouts))
            check_same_count(len(micro_batches), f"micro-batches in step {step}", world.device)

            lr = set_learning_rate(optimizer, learning_rate(step, cfg.optim, cfg.max_steps))
            metrics = train_step(model, micro_batches, cfg, world)  # ends reading its sums: the device is done
            backward_end = time.time()
            grad_norm = clip_grad_norm(model, cfg.optim.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if world.device.type == "cuda":
                torch.cuda.synchronize(world.device)  # the optimizer's time, not the publish's
            optimizer_end = time.time()

            published = publish_weights(model, tokenizer, cfg, step, world, publisher)
            train_end = time.time()
            # Every rank read its file before joining the collective in publish_weights, so rank 0 may
            # delete the whole step folder now.
            if world.is_main and not cfg.keep_rollouts:
                shutil.rmtree(step_dir(cfg.output_dir, step), ignore_errors=True)

            if world.is_main:
                tokens_per_s = metrics.pop("tokens") / max(train_end - train_start, 1e-9)
                metrics.update(
                    {
                        "grad_norm": grad_norm,
                        "lr": lr,
                        "batch/micro_batches": len(micro_batches),
                        "batch/fill": sum(mb.num_tokens for mb in micro_batches)
                        / max(len(micro_batches) * cfg.seq_len, 1),
                        "perf/tokens_per_s": tokens_per_s,
                        "time/step": train_end - step_start,
                        "time/wait_for_batch": train_start - step_start,
                        "time/forward_backward": backward_end - train_start,
                        "time/optimizer": optimizer_end - backward_end,
                        "time/publish": train_end - optimizer_end,
                        "time/publish_gather": published.gather,
                        "time/publish_write": published.write,
                        "timestamp/train_start": train_start,
                        "timestamp/train_end": train_end,
                    }
                )
                logger.log(step, metrics)
                print(
                    f"step {step} | loss {metrics['loss']:.4f} | mismatch_kl {metrics['mismatch_kl']:.2e} | "
                    f"{tokens_per_s:.0f} tok/s",
                    flush=True,
                )
            if cfg.ckpt.interval and step % cfg.ckpt.interval == 0:
                save_start = time.monotonic()
                with timed(f"trainer: saving checkpoint step {step}", save_seconds, shown=world.is_main):
                    checkpoint.save(cfg.output_dir, TrainerProgress(step), model, optimizer, world)
                save_seconds = time.monotonic() - save_start
                if world.is_main:
                    checkpoints.prune(cfg.output_dir, checkpoints.RL_PARTS, cfg.ckpt.keep_last)
            profiler.step()
        profiler.stop()
        publisher.wait()  # the last version on disk
        return 0
    finally:
        close_distributed()
