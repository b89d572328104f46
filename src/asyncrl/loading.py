"""Load any Hugging Face causal LM and its tokenizer: a local folder (ours from `asyncrl model init`, a
published `weights/step_N`) or a hub id already in the local cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from asyncrl.config.schema import ModelConfig
from asyncrl.errors import AsyncRLError
from asyncrl.placement import rank_device

hf_logging.disable_progress_bar()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def _missing(name: str, error: Exception) -> AsyncRLError:
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    if Path(name).expanduser().is_dir():
        return AsyncRLError(f"model folder '{name}' could not be loaded: {reason}")
    return AsyncRLError(
        f"model '{name}' could not be loaded: {reason} (a hub id needs the network or a copy in the Hugging Face "
        "cache; or set model.name to a local model folder, e.g. one made by `asyncrl model init`)"
    )


def check_model_name(name: str) -> None:
    looks_local = (
        name.startswith((".", "/", "~")) or name.count("/") != 1 or Path(name).exists() or Path(name).parent.is_dir()
    )
    if looks_local and not Path(name).expanduser().is_dir():
        raise AsyncRLError(
            f"model path '{name}' not found (set model.name to a local model folder, e.g. one made by "
            "`asyncrl model init`, or a Hugging Face id)"
        )


def check_model(name: str) -> PreTrainedTokenizerBase:
    """Fail with one line unless `name` is a loadable model: for a local folder, a config.json that parses and
    names a known architecture, and weights; its tokenizer is returned."""
    check_model_name(name)
    folder = Path(name).expanduser()
    if folder.is_dir():
        config = folder / "config.json"
        if not config.is_file():
            raise AsyncRLError(
                f"model folder '{name}' has no config.json (model.name must be a Hugging Face model folder, e.g. "
                "one made by `asyncrl model init` or a published weights/step_N)"
            )
        try:
            json.loads(config.read_text())
        except ValueError as error:
            raise AsyncRLError(f"model folder '{name}': config.json is not valid JSON ({error})") from None
        if not any(any(folder.glob(pattern)) for pattern in WEIGHT_FILES):
            raise AsyncRLError(
                f"model folder '{name}' holds no weights ({' or '.join(WEIGHT_FILES)}); was it copied whole?"
            )
    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError, KeyError) as error:
        raise _missing(name, error) from None
    return load_tokenizer(name)


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    check_model_name(name)
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise _missing(name, e) from None


def load_model(
    config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> PreTrainedModel:
    check_model_name(config.name)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            config.name,
            dtype=dtype or DTYPES[config.dtype],
            attn_implementation=config.attn_implementation,
        )
    except (OSError, ValueError) as e:
        raise _missing(config.name, e) from None
    return model.to(device)


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """This process's device (placement.rank_device): local rank r of 'cuda' on cuda:r, of 'cuda:N' on cuda:N + r."""
    gpus = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    return torch.device(rank_device(device, local_rank, gpus))
