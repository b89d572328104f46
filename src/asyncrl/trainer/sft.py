"""`asyncrl sft`: supervised fine-tuning on an environment's reference answers, loss on assistant tokens.

    for step n = 1, 2, ...:
        take batch_size examples → this rank's share → chat template → pack into rows of seq_len
        for each row: forward → -log p(assistant tokens) / N → backward      (N: assistant tokens, all ranks)
        clip → AdamW step → log
    save a complete Hugging Face model to output_dir/final

Same model, FSDP2 and optimizer code as the RL trainer, so `asyncrl rl` starts from `final/` directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import islice

import torch
from transformers import PreTrainedTokenizerBase

from asyncrl.config.schema import SFTConfig
from asyncrl.environments import load_environment
from asyncrl.environments.base import Messages
from asyncrl.errors import AsyncRLError
from asyncrl.loading import load_tokenizer
from asyncrl.metrics import MetricsLogger
from asyncrl.trainer.distributed import all_reduce_sum, close_distributed, init_distributed, max_over_ranks
from asyncrl.trainer.loss import token_logprobs
from asyncrl.trainer.model import (
    clip_grad_norm,
    full_state_dict,
    learning_rate,
    make_optimizer,
    parallelize,
    set_learning_rate,
    setup_model,
)
from asyncrl.transport.weights import save_model_folder

END_OF_TURN = "<|im_end|>"


@dataclass
class SFTSample:
    input_ids: list[int]
    loss_mask: list[bool]  # True on the assistant's answer and the token that closes its turn


@dataclass
class PackedRow:
    input_ids: torch.Tensor
    position_ids: torch.Tensor  # restart at 0 for each sample, so attention keeps samples apart
    loss_mask: torch.Tensor


def tokenize_sft(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> SFTSample:
    """Chat-template a conversation that ends with the assistant's answer; mask everything but the answer.

    The answer's tokens are what the full conversation adds to the prompt rendered with the generation
    prompt, up to and including the end-of-turn token (what the policy must learn to emit to stop).
    """
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=True, return_dict=False, add_generation_prompt=True)
    if full[: len(prompt)] != prompt:
        raise AsyncRLError(
            "the chat template renders the prompt differently with and without the answer, so the answer's "
            "tokens cannot be found (use a model whose chat template appends each message unchanged)"
        )
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if end is None or end == tokenizer.unk_token_id:
        end = tokenizer.eos_token_id
    answer = full[len(prompt) :]
    answer_length = answer.index(end) + 1 if end in answer else len(answer)
    mask = [False] * len(prompt) + [True] * answer_length + [False] * (len(answer) - answer_length)
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


def train_sft(cfg: SFTConfig) -> int:
    world = init_distributed(cfg.device, cfg.num_threads, cfg.seed)
    try:
        tokenizer = load_tokenizer(cfg.model.name)
        model = parallelize(setup_model(cfg.model, world.device), world.world_size, world.device, cfg.model.dtype)
        optimizer = make_optimizer(model, cfg.optim)
        environment = load_environment(cfg.data.environment.name, **cfg.data.environment.args)
        examples = environment.examples(cfg.seed)  # endless; every rank draws the same stream
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        logger = MetricsLogger(cfg.output_dir, "sft") if world.is_main else None
        if world.is_main:
            print(
                f"sft: {world.world_size} rank(s) on {world.device}, model {cfg.model.name}, "
                f"{cfg.data.environment.name} data, {cfg.max_steps} steps",
                flush=True,
            )

        for step in range(1, cfg.max_steps + 1):
            step_start = time.time()
            batch = list(islice(examples, cfg.data.batch_size))
            samples = [tokenize_sft(tokenizer, ex.sft_messages()) for ex in batch[world.rank :: world.world_size]]
            rows = pack_samples(samples, cfg.seq_len)
            rows += [padding_row(pad_token_id)] * (max_over_ranks(len(rows), world.device) - len(rows))

            local = torch.tensor(
                [sum(int(r.loss_mask.sum()) for r in rows), sum(r.input_ids.numel() for r in rows)], device=world.device
            )
            answer_tokens, total_tokens = (int(v) for v in all_reduce_sum(local))
            lr = set_learning_rate(optimizer, learning_rate(step, cfg.optim))
            loss_sum = torch.zeros((), device=world.device)
            for row in rows:
                input_ids, mask = row.input_ids.to(world.device), row.loss_mask.to(world.device)
                logits = model(
                    input_ids=input_ids[None], position_ids=row.position_ids.to(world.device)[None], use_cache=False
                ).logits[0]
                logprobs, _ = token_logprobs(logits, input_ids)
                loss = -torch.where(mask, logprobs, 0.0).sum() / max(answer_tokens, 1)
                loss.backward()
                loss_sum += loss.detach()
            grad_norm = clip_grad_norm(model, cfg.optim.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = float(all_reduce_sum(loss_sum))

            if world.is_main and step % cfg.log_interval == 0:
                tokens_per_s = total_tokens / max(time.time() - step_start, 1e-9)
                logger.log(step, {"loss": loss, "lr": lr, "grad_norm": grad_norm, "perf/tokens_per_s": tokens_per_s})
                print(f"step {step} | loss {loss:.4f} | lr {lr:.2e} | {tokens_per_s:.0f} tok/s", flush=True)

        state_dict = full_state_dict(model)  # collective: every rank takes part
        if world.is_main:
            final = save_model_folder(
                cfg.output_dir / "final", state_dict, model.config, tokenizer, model.generation_config
            )
            print(f"sft: saved {final}", flush=True)
        return 0
    finally:
        close_distributed()
