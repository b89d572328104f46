"""LoRA (peft) on the trained model: only low-rank adapters train, and only they are published.

`apply_lora` wraps the plain model before FSDP2 sharding, so the adapters shard with the unit around them.
Inference never sees peft: a published adapter folder (transport/weights.py) is merged into the base
weights when it is loaded, W' = W + (alpha / rank) · B @ A, and served like any state dict.
peft is imported only where LoRA is on: runs without LoRA neither need it nor pay for its import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PreTrainedModel

from asyncrl.config.schema import LoRAConfig
from asyncrl.errors import AsyncRLError
from asyncrl.transport import weights

if TYPE_CHECKING:
    from peft import PeftModel


def apply_lora(model: PreTrainedModel, cfg: LoRAConfig | None) -> PreTrainedModel | PeftModel:
    """Freeze the model and add adapters to `cfg.target_modules`; the model unchanged when LoRA is off.

    B starts at zero, so version 0 of a LoRA run is exactly the base model.
    """
    if cfg is None:
        return model
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = sorted(set(cfg.target_modules) - present)
    if missing:
        raise AsyncRLError(
            f"model.lora.target_modules {missing} match no layer of {type(model).__name__} "
            f"(its linear layers include: {', '.join(sorted(n for n in present if n.endswith('proj')))})"
        )
    peft_config = LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules)
    )
    base = model.name_or_path
    model = get_peft_model(model, peft_config)
    # The adapter folder points at the base model; a relative path would break from another directory.
    model.peft_config["default"].base_model_name_or_path = str(Path(base).resolve()) if Path(base).is_dir() else base
    return model


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")  # peft's wrapper, without importing peft


def adapter_config(model: PeftModel) -> dict:
    """The `adapter_config.json` of the model's adapter, as peft writes it."""
    config = model.peft_config["default"].to_dict()
    config["target_modules"] = sorted(config["target_modules"])  # a set in peft: JSON needs a list
    config["peft_type"] = str(config["peft_type"].value)
    return config


def adapter_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter weights on CPU in peft's file layout (`...q_proj.lora_A.weight`) on rank 0; other ranks get
    an empty dict. A collective: every rank must call it. Gathers only the trainable (adapter) tensors."""
    from peft import get_peft_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state_dict = get_model_state_dict(model, options=options)
    if not state_dict:
        return {}
    return get_peft_model_state_dict(model, state_dict=state_dict)


def merged_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The base weights with the adapter merged in, on rank 0 (others get an empty dict): a plain model, for
    the final SFT result. A collective: every rank must call it."""
    adapter = adapter_state_dict(model)
    if not adapter:
        return {}
    config = adapter_config(model)
    return weights.merge_adapter(weights.base_state_dict(config["base_model_name_or_path"]), adapter, config)
