"""One trainer rank of `test_context_parallel.py` (run under torchrun, two ranks): for each kind of row ("packed":
three documents per row; "one_document": one long document; "moe": two documents, for a mixture-of-experts model
with expert parallelism over the same two ranks and a balancing loss) and for trainer.cp = 1 and 2, two RL steps
of a small model through the trainer's own code (`parallelize`, `data_rank`, `wait_for_batch`, `train_step`,
`clip_grad_norm`, AdamW). Each step's two rows are written as rollout files, one per data-parallel rank, so with
cp = 1 each rank reads one row and with cp = 2 both ranks read the same file of both rows. Rank 0 writes each
step's metrics, full gradients and the weights after the last step to the given folder."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from expert_parallel_worker import Recorder

from asyncrl.config.schema import LossConfig, ModelConfig, OptimConfig, PerfConfig, TrainerConfig
from asyncrl.trainer.distributed import close_distributed, init_distributed
from asyncrl.trainer.model import make_optimizer, parallelize, setup_model
from asyncrl.trainer.rl import data_rank
from asyncrl.transport.rollouts import MicroBatch, rank_file, wait_for_batch, write_batch

# The documents of each row: "packed" rows are 60 tokens (30 per rank), the others 63 tokens (padded to 64 for two
# ranks). Its loss is sequence-level (GSPO) for packed rows, token-level for the others.
ROWS = {"packed": [19, 24, 17], "one_document": [63], "moe": [30, 33]}
LOSS = {"packed": "gspo", "one_document": "default", "moe": "default"}
CHECKPOINTING = {"packed": "off", "one_document": "selective", "moe": "selective"}  # recompute: the exchange again
EP = {"packed": 1, "one_document": 1, "moe": 2}


def make_row(lengths: list[int], vocab_size: int, generator: torch.Generator) -> MicroBatch:
    """A packed row of documents of `lengths`; about 3 in 4 tokens past each document's first are loss tokens,
    and each document was sampled at its own temperature."""
    tokens = sum(lengths)
    position_ids = torch.cat([torch.arange(length) for length in lengths])
    loss_mask = (position_ids > 0) & (torch.rand(tokens, generator=generator) < 0.75)
    per_document = torch.tensor(lengths)
    advantages = torch.randn(len(lengths), generator=generator).repeat_interleave(per_document)
    temperature = (0.6 + torch.rand(len(lengths), generator=generator)).repeat_interleave(per_document)
    return MicroBatch(
        input_ids=torch.randint(0, vocab_size, (tokens,), generator=generator),
        position_ids=position_ids,
        loss_mask=loss_mask,
        advantages=advantages * loss_mask,
        inference_logprobs=-torch.rand(tokens, generator=generator) * 4 * loss_mask,
        temperature=temperature,
        sample_lengths=per_document,
    )


def run(model_name: str, case: str, cp: int, output: Path, world) -> None:
    cfg = TrainerConfig(
        model=ModelConfig(name=model_name, impl="native"),
        seq_len=64,
        cp=cp,
        ep=EP[case],
        loss=LossConfig(type=LOSS[case], router_aux_coef=0.01),
        perf=PerfConfig(activation_checkpointing=CHECKPOINTING[case], logprob_chunk_size=16),
    )
    model = setup_model(cfg.model, world.device, cfg.perf)
    model = parallelize(model, world.world_size, world.device, "float32", cfg.perf, cfg.ep, cfg.cp)
    optimizer = make_optimizer(model, OptimConfig(lr=1e-2))
    rollouts = output / f"{case}_cp{cp}"
    data_ranks = world.world_size // cp
    recorder = Recorder(model, optimizer, cfg, world)
    for step in range(1, 3):
        generator = torch.Generator().manual_seed(step)  # the same two rows whatever cp is
        rows = [make_row(ROWS[case], model.config.vocab_size, generator) for _ in range(2)]
        if world.is_main:
            for rank in range(data_ranks):
                write_batch(rank_file(rollouts, step, rank), rows[rank::data_ranks])
        dist.barrier()
        recorder.step(f"step{step}", wait_for_batch(rollouts, step, data_rank(world.rank, cp), timeout=30))
    recorder.save(output, f"{case}_cp{cp}")
    del model, optimizer, recorder  # FSDP's process groups go before the group they were split from


def main(dense_model: str, moe_model: str, output: Path) -> None:
    world = init_distributed("cpu", 1, seed=0)
    for case in ROWS:
        for cp in (1, 2):
            run(moe_model if case == "moe" else dense_model, case, cp, output, world)
    close_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
