"""What SFT trains on: conversations from files or a Hugging Face dataset, or an environment's examples.

Rows of a file or dataset become conversations through their `messages` column (chat messages, tool calls
included), or else their `prompt` and `completion` columns (each a string or a list of messages); an
optional `tools` column gives the chat template its tool schemas. An environment's example becomes its
prompt followed by the reference answer. The held-out eval split is the first examples of the stream; the
training stream skips them in every epoch.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from asyncrl.config.schema import SFTDataConfig
from asyncrl.data import as_messages, as_tools, epoch_order, load_rows
from asyncrl.environments import load_environment
from asyncrl.environments.base import Messages
from asyncrl.errors import AsyncRLError


@dataclass(frozen=True)
class Chat:
    """One training conversation and the tools its chat template lists."""

    messages: Messages
    tools: list[dict] | None = None

    def identity(self) -> str:
        return json.dumps([self.messages, self.tools], sort_keys=True)


@dataclass
class SFTData:
    held_out: list[Chat]
    training: Iterator[Chat]
    size: int | None  # training conversations over all epochs, when the data is finite and known
    source: str  # what the data is, for the start-up line

    def steps(self, batch_size: int, max_steps: int) -> int:
        """Optimizer steps: max_steps, or fewer when the data ends first (a last, smaller batch counts)."""
        return max_steps if self.size is None else min(max_steps, math.ceil(self.size / batch_size))


def chat_from_row(row: dict[str, Any], cfg: SFTDataConfig) -> Chat:
    tools = as_tools(row.get(cfg.tools_column))
    if row.get(cfg.messages_column) is not None:
        return Chat(as_messages(row[cfg.messages_column], "user", cfg.messages_column), tools)
    if row.get(cfg.prompt_column) is not None and row.get(cfg.completion_column) is not None:
        prompt = as_messages(row[cfg.prompt_column], "user", cfg.prompt_column)
        return Chat(prompt + as_messages(row[cfg.completion_column], "assistant", cfg.completion_column), tools)
    raise AsyncRLError(
        f"a data row has columns {sorted(row)}; SFT needs a '{cfg.messages_column}' column, or "
        f"'{cfg.prompt_column}' and '{cfg.completion_column}' (set data.messages_column, data.prompt_column, "
        "data.completion_column)"
    )


def split_held_out(chats: Iterator[Chat], size: int) -> tuple[list[Chat], Iterator[Chat]]:
    """The eval split is the stream's first `size` conversations. Training draws the rest, skipping any equal
    to a held-out one (generated data repeats itself; every epoch repeats a file), so the two never meet."""
    held_out = list(itertools.islice(chats, size))
    if not held_out:
        return [], chats
    seen = {chat.identity() for chat in held_out}
    return held_out, (chat for chat in chats if chat.identity() not in seen)


def load_sft_data(cfg: SFTDataConfig, seed: int, held_out_size: int) -> SFTData:
    if cfg.path is None:
        environment = load_environment(cfg.environment.name, **cfg.environment.args)
        # Endless for generated tasks; a finite stream is repeated `epochs` times, each epoch under its own seed.
        examples = itertools.chain.from_iterable(environment.examples(seed + epoch) for epoch in range(cfg.epochs))
        chats = (Chat(example.sft_messages(), environment.tools) for example in examples)
        held_out, training = split_held_out(chats, held_out_size)
        return SFTData(held_out, training, None, f"{cfg.environment.name} data")

    rows = load_rows(cfg.path, cfg.split, cfg.subset)
    if len(rows) == 0:
        raise AsyncRLError(f"data '{cfg.path}' has no rows")
    chat_from_row(rows[0], cfg)  # a missing column fails here, with its one line, not mid-run
    order = epoch_order(len(rows), seed, cfg.epochs, cfg.shuffle)
    held_out, training = split_held_out((chat_from_row(rows[i], cfg) for i in order), held_out_size)
    seen = {chat.identity() for chat in held_out}
    per_epoch = len(rows) if not seen else sum(chat_from_row(row, cfg).identity() not in seen for row in rows)
    if per_epoch == 0:
        raise AsyncRLError(f"data '{cfg.path}' has {len(rows)} rows and eval.size holds them all out; lower eval.size")
    source = f"{len(rows)} conversations from {cfg.path} ({len(held_out)} held out), {cfg.epochs} epoch(s)"
    return SFTData(held_out, training, per_epoch * cfg.epochs, source)
