"""`asyncrl sft`: supervised fine-tuning on chat data (files, a Hugging Face dataset, or an environment's
reference answers; `sft_data.py`), loss on assistant tokens.

    for step n = 1, 2, ... (max_steps, or fewer when the data's epochs end first):
        take batch_size conversations → this rank's share → chat template → pack into rows of seq_len
        for each row: forward → -log p(assistant tokens) / N → backward      (N: assistant tokens, all ranks)
        clip → AdamW step → log
        every eval.interval steps: -log p of the held-out examples' answers → eval/loss
        every ckpt.interval steps: checkpoint (model, optimizer, step, generators, examples drawn)
        every save_interval steps: a Hugging Face model in output_dir/weights/step_n
    save a complete Hugging Face model to output_dir/final (with LoRA: the adapter merged into the base)

Same model, FSDP2 and optimizer code as the RL trainer, so `asyncrl rl` starts from `final/` directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from asyncrl import checkpoints
from asyncrl.config.schema import SFTConfig
from asyncrl.environments.base import Messages
from asyncrl.errors import AsyncRLError
from asyncrl.loading import load_tokenizer
from asyncrl.metrics import MetricsLogger
from asyncrl.models.checkpoint import checkpoint_state_dict
from asyncrl.preflight import check_output_dir
from asyncrl.progress import ProgressBar, Throughput, timed
from asyncrl.run_lock import RunLock
from asyncrl.trackers import Trackers
from asyncrl.trainer import checkpoint
from asyncrl.trainer.checkpoint import TrainerProgress
from asyncrl.trainer.distributed import World, all_reduce_sum, close_distributed, init_distributed, max_over_ranks
from asyncrl.trainer.logprobs import compute_logprobs, row_logprobs
from asyncrl.trainer.lora import is_lora, merged_state_dict
from asyncrl.trainer.model import (
    clip_grad_norm,
    full_state_dict,
    make_optimizer,
    parallelize,
    set_learning_rate,
    setup_model,
)
from asyncrl.trainer.routing import RoutingMetrics, balance_loss
from asyncrl.trainer.schedule import learning_rate
from asyncrl.trainer.sft_data import Chat, load_sft_data
from asyncrl.transport.weights import save_model_folder

END_OF_TURN = "<|im_end|>"
# Steps in a row without an answer token before SFT stops: nothing can be learned from them.
EMPTY_STEPS_LIMIT = 3
# A loss that has not set a new low (by 1%) for this many steps is said to have sat flat, once per plateau.
FLAT_STEPS = 200


class PlateauWatch:
    """Says, once per plateau, that the loss has not fallen for FLAT_STEPS steps: a learning rate too low
    or too high, or data with nothing left to learn, otherwise goes unnoticed in a long run."""

    def __init__(self, start_step: int):
        self.best, self.best_step, self.warned = float("inf"), start_step, False

    def add(self, step: int, loss: float) -> str | None:
        if loss < self.best * 0.99:
            self.best, self.best_step, self.warned = loss, step, False
            return None
        if self.warned or step - self.best_step < FLAT_STEPS:
            return None
        self.warned = True
        return (
            f"sft: the loss has not fallen for {step - self.best_step} steps (lowest {self.best:.4g} at step "
            f"{self.best_step}, now {loss:.4g}): check optim.lr and the data"
        )


@dataclass
class SFTSample:
    input_ids: list[int]
    loss_mask: list[bool]  # True on the assistant's answer and the token that closes its turn


@dataclass
class PackedRow:
    input_ids: torch.Tensor
    position_ids: torch.Tensor  # restart at 0 for each sample, so attention keeps samples apart
    loss_mask: torch.Tensor


def tokenize_sft(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    tools: list[dict] | None = None,
    loss_on: str = "all_assistant",
) -> SFTSample:
    """Chat-template a conversation; the loss mask covers the assistant's turns (every one, or the last) and
    nothing else.

    An assistant turn's tokens are what rendering the conversation through that turn adds to the rendering
    of the conversation before it with the generation prompt, up to and including the end-of-turn token (what
    the policy must learn to emit to stop). Its tool calls are part of it, as the template writes them.
    """

    def render(part: Messages, add_generation_prompt: bool = False) -> list[int]:
        return tokenizer.apply_chat_template(
            part, tools=tools, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
        )

    full = render(messages)
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if end is None or end == tokenizer.unk_token_id:
        end = tokenizer.eos_token_id
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    mask = [False] * len(full)
    for i in turns[-1:] if loss_on == "last_assistant" else turns:
        prompt = render(messages[:i], add_generation_prompt=True)
        through = render(messages[: i + 1])
        if through[: len(prompt)] != prompt or full[: len(through)] != through:
            raise AsyncRLError(
                f"the chat template renders the conversation before assistant turn {turns.index(i) + 1} differently "
                "once that turn is added, so the turn's tokens cannot be found (train on the last turn only: "
                "data.loss_on = 'last_assistant', or use a model whose chat template appends each message unchanged)"
            )
        answer = through[len(prompt) :]
        length = answer.index(end) + 1 if end in answer else len(answer)
        mask[len(prompt) : len(prompt) + length] = [True] * length
    return SFTSample(full, mask)


def pack_samples(samples: list[SFTSample], seq_len: int) -> list[PackedRow]:
    """Greedily pack samples, in order, into rows of at most `seq_len` tokens; longer samples are cut."""
    rows: list[list[SFTSample]] = []
    used = seq_len
    for sample in samples:
        sample = SFTSample(sample.input_ids[:seq_len], sample.loss_mask[:seq_len])
        if used + len(sample.input_ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(sample)
        used += len(sample.input_ids)
    return [
        PackedRow(
            input_ids=torch.tensor([t for s in row for t in s.input_ids]),
            position_ids=torch.cat([torch.arange(len(s.input_ids)) for s in row]),
            loss_mask=torch.tensor([m for s in row for m in s.loss_mask]),
        )
        for row in rows
    ]


def padding_row(pad_token_id: int) -> PackedRow:
    """A one-token row with no loss: lets a rank with fewer rows match the others' forward/backward count."""
    return PackedRow(torch.tensor([pad_token_id]), torch.tensor([0]), torch.tensor([False]))


def rank_rows(
    chats: list[Chat],
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    world: World,
    pad_token_id: int,
    loss_on: str = "all_assistant",
) -> list[PackedRow]:
    """This rank's share of `chats`, chat-templated and packed, padded with empty rows to the most rows any
    rank has (FSDP needs the same number of forward passes on every rank)."""
    mine = chats[world.rank :: world.world_size]
    samples = [tokenize_sft(tokenizer, chat.messages, chat.tools, loss_on) for chat in mine]
    rows = pack_samples(samples, seq_len)
    return rows + [padding_row(pad_token_id)] * (max_over_ranks(len(rows), world.device) - len(rows))


@torch.no_grad()
def eval_loss(model: torch.nn.Module, rows: list[PackedRow], device: torch.device, chunk_size: int) -> float:
    """Mean -log p of the answer tokens of the held-out examples, over all ranks. A collective."""
    sums = torch.zeros(2, device=device)
    for row in rows:
        input_ids, mask = row.input_ids.to(device), row.loss_mask.to(device)
        logprobs, _ = compute_logprobs(
            model, input_ids, row.position_ids.to(device), chunk_size=chunk_size, with_entropy=False
        )
        sums += torch.stack([-torch.where(mask, logprobs, 0.0).sum(), mask.sum().float()])
    nll, tokens = all_reduce_sum(sums).tolist()
    return nll / max(tokens, 1.0)


def save_model(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, folder: Path, world: World) -> None:
    """A complete Hugging Face model folder (with LoRA: the base model with the adapter merged in).
    Collectives: every rank takes part."""
    if is_lora(model):
        state_dict = merged_state_dict(model)  # the base model's own layout
    else:
        state_dict = checkpoint_state_dict(model.config, full_state_dict(model))
    if world.is_main:
        saved = save_model_folder(folder, state_dict, model.config, tokenizer, model.generation_config)
        print(f"sft: saved {saved}", flush=True)


def train_sft(cfg: SFTConfig) -> int:
    world = init_distributed(cfg.device, cfg.num_threads, cfg.seed)
    trackers, bar, lock = None, None, None
    try:
        if world.is_main:  # one run at a time in output_dir (run_lock.py)
            check_output_dir(Path(cfg.output_dir))
            lock = RunLock.acquire(cfg.output_dir, "asyncrl sft")
        tokenizer = load_tokenizer(cfg.model.name)
        with timed(f"sft: loading {cfg.model.name}", shown=world.is_main):
            model = setup_model(cfg.model, world.device, cfg.perf)
            model = parallelize(model, world.world_size, world.device, cfg.model.dtype, cfg.perf, cfg.ep)
        optimizer = make_optimizer(model, cfg.optim)
        # Every rank draws the same stream. The held-out split is its first examples.
        data = load_sft_data(cfg.data, cfg.seed, cfg.eval.size)
        examples = data.training
        max_steps = data.steps(cfg.data.batch_size, cfg.max_steps)
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        loss_on = cfg.data.loss_on
        eval_rows = (
            rank_rows(data.held_out, tokenizer, cfg.seq_len, world, pad_token_id, loss_on) if data.held_out else []
        )
        progress = TrainerProgress(step=0)
        if cfg.resume is not None:
            with timed("sft: loading the checkpoint", shown=world.is_main):
                progress = checkpoint.resume(
                    cfg.output_dir, checkpoints.SFT_PARTS, cfg.resume.step, model, optimizer, world
                )
            examples = islice(examples, progress.examples_drawn, None)
            if world.is_main:
                checkpoints.rewind(cfg.output_dir, progress.step)
        elif checkpoints.saved_steps(cfg.output_dir):
            raise AsyncRLError(
                f"output_dir '{cfg.output_dir}' holds checkpoints of an earlier run (steps "
                f"{', '.join(map(str, checkpoints.saved_steps(cfg.output_dir)))}); continue it with --resume, "
                "or set output_dir to a new folder"
            )
        if world.is_main:
            trackers = Trackers.open(cfg.wandb, cfg.tensorboard, cfg.output_dir, cfg.model_dump(mode="json"))
        logger = MetricsLogger(cfg.output_dir, "sft", trackers) if world.is_main else None
        if world.is_main:
            shorter = f" (the data lasts {max_steps} of max_steps {cfg.max_steps})" if max_steps < cfg.max_steps else ""
            print(
                f"sft: {world.world_size} rank(s) on {world.device}, model {cfg.model.name}, {data.source}, "
                f"{max_steps} steps{shorter}",
                flush=True,
            )
        bar = ProgressBar("sft", cfg.max_steps, progress.step, "steps", shown=world.is_main)
        throughput = Throughput(window=cfg.log_interval)
        save_seconds = None  # the last checkpoint save's time: the next one's ETA

        empty = 0  # steps in a row without an answer token
        plateau = PlateauWatch(progress.step)
        for step in range(progress.step + 1, max_steps + 1):
            step_start = time.time()
            batch = list(islice(examples, cfg.data.batch_size))
            if not batch:  # a finite environment stream, shorter than max_steps: end here, saying so
                if world.is_main:
                    print(
                        f"sft: the data ran out after {progress.examples_drawn} examples ({cfg.data.epochs} "
                        f"epoch(s)): stopping at step {step - 1} of {max_steps} (raise data.epochs to train longer)",
                        flush=True,
                    )
                break
            rows = rank_rows(batch, tokenizer, cfg.seq_len, world, pad_token_id, loss_on)
            local = torch.tensor(
                [sum(int(r.loss_mask.sum()) for r in rows), sum(r.input_ids.numel() for r in rows)], device=world.device
            )
            answer_tokens, total_tokens = (int(v) for v in all_reduce_sum(local))
            progress = TrainerProgress(  # the token counts are the run's, carried over a resume by the checkpoint
                step,
                progress.examples_drawn + len(batch),
                progress.answer_tokens + answer_tokens,
                progress.total_tokens + total_tokens,
            )
            empty = 0 if answer_tokens else empty + 1
            if empty == EMPTY_STEPS_LIMIT:
                raise AsyncRLError(
                    f"steps {step - empty + 1}-{step} had no answer token within seq_len = {cfg.seq_len} (the "
                    "prompts fill it, or the data has no assistant turn to train on), so nothing is learned; raise "
                    "seq_len"
                )
            lr = set_learning_rate(optimizer, learning_rate(step, cfg.optim, max_steps))
            loss_sum = torch.zeros((), device=world.device)
            routing = RoutingMetrics(model, world.device)
            for row in rows:
                input_ids, mask = row.input_ids.to(world.device), row.loss_mask.to(world.device)
                position_ids = row.position_ids.to(world.device)
                row_out = row_logprobs(
                    model,
                    input_ids,
                    position_ids,
                    chunk_size=cfg.perf.logprob_chunk_size,
                    with_entropy=False,
                    compiled=cfg.perf.compile,
                )
                logprobs, row_routing = row_out.logprobs, row_out.routing
                loss = -torch.where(mask, logprobs, 0.0).sum() / max(answer_tokens, 1)
                if row_routing is not None:
                    loss = loss + balance_loss(row_routing, cfg.router_aux_coef, total_tokens)
                loss.backward()
                loss_sum += loss.detach()
                routing.add(row_routing)
            grad_norm = clip_grad_norm(model, cfg.optim.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = float(all_reduce_sum(loss_sum))

            # Over the last log_interval steps: one step's figure swings widely (a busy CPU, rows of other lengths).
            tokens_per_s = throughput.add(total_tokens, time.time() - step_start)
            bar.advance(info=f"loss {loss:.4f}  {tokens_per_s:.0f} tok/s")
            metrics = {}
            routing_metrics = routing.metrics()  # a collective: every step, on every rank
            if step % cfg.log_interval == 0:
                metrics = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "perf/tokens_per_s": tokens_per_s}
                metrics.update(routing_metrics)
                metrics.update({"tokens/answer": progress.answer_tokens, "tokens/total": progress.total_tokens})
            if eval_rows and (step % cfg.eval.interval == 0 or step == max_steps):
                metrics["eval/loss"] = eval_loss(model, eval_rows, world.device, cfg.perf.logprob_chunk_size)
            if world.is_main and metrics:
                logger.log(step, metrics)
                shown = {k: v for k, v in metrics.items() if "/layer_" not in k}  # per-layer ones: metrics.jsonl
                print(f"step {step} | " + " | ".join(f"{k} {v:.4g}" for k, v in shown.items()), flush=True)
            flat = plateau.add(step, loss)
            if flat and world.is_main:
                print(f"warning: {flat}", flush=True)
            if cfg.ckpt.interval and step % cfg.ckpt.interval == 0:
                save_start = time.monotonic()
                with timed(f"sft: saving checkpoint step {step}", save_seconds, shown=world.is_main):
                    checkpoint.save(cfg.output_dir, progress, model, optimizer, world)
                save_seconds = time.monotonic() - save_start
                if world.is_main:
                    checkpoints.prune(cfg.output_dir, checkpoints.SFT_PARTS, cfg.ckpt.keep_last)
            if cfg.save_interval and step % cfg.save_interval == 0 and step < max_steps:
                save_model(model, tokenizer, cfg.output_dir / "weights" / f"step_{step}", world)

        save_model(model, tokenizer, cfg.output_dir / "final", world)
        if world.is_main:
            print(
                f"sft: trained {progress.step} steps, {progress.answer_tokens:,} answer tokens "
                f"({progress.total_tokens:,} tokens in all)",
                flush=True,
            )
        return 0
    finally:
        if bar is not None:
            bar.close()
        if trackers is not None:
            trackers.close()
        if lock is not None:
            lock.release()
        close_distributed()
