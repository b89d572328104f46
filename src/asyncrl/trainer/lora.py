"""LoRA (peft) on the trained model: only low-rank adapters train, and only they are published.

`apply_lora` wraps the plain model before FSDP2 sharding, so the adapters shard with the unit around them.
A mixture of experts' routed experts are no linear layers peft could wrap: with `model.lora.experts` each
experts module gets adapters of its own (`models/moe.py`, `Experts.add_lora`), published in peft's layout for
the checkpoint's one module per expert (`split_expert_adapters`).
Inference never sees peft: a published adapter folder (transport/weights.py) is merged into the base
weights when it is loaded, W' = W + (alpha / rank) · B @ A, and served like any state dict.
peft is imported only where LoRA is on: runs without LoRA neither need it nor pay for its import.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PreTrainedModel

from asyncrl.config.schema import LoRAConfig
from asyncrl.errors import AsyncRLError
from asyncrl.models.moe import Experts, split_expert_adapters
from asyncrl.models.transformer import CausalLM
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
    if not isinstance(model, CausalLM) and any(p.dim() == 3 for p in model.parameters()):
        raise AsyncRLError(
            f"LoRA on {type(model).__name__}, a mixture of experts, needs model.impl = 'native' (peft rewrites "
            "transformers' expert layers into adapters of its own layout, which published weights cannot carry)"
        )
    experts = [module for module in model.modules() if isinstance(module, Experts)]
    routed = {"gate_proj", "up_proj", "down_proj"} & set(cfg.target_modules)
    if cfg.experts:
        if not experts:
            raise AsyncRLError(
                "model.lora.experts adapts routed experts: it needs a mixture-of-experts model and "
                "model.impl = 'native'"
            )
        if not routed:
            raise AsyncRLError("model.lora.experts: target_modules names none of gate_proj, up_proj, down_proj")
        for module in experts:
            module.add_lora(cfg.rank, cfg.alpha, tuple(sorted(routed)))
    if experts:  # the routed experts' projections are no modules; in a model of experts only, none is
        present |= routed
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
    with hidden_model_type(model):
        model = get_peft_model(model, peft_config)
    for module in experts:  # peft froze everything that is not its own
        for name in module.lora_projections:
            getattr(module, f"lora_{name}_A").requires_grad_(True)
            getattr(module, f"lora_{name}_B").requires_grad_(True)
    # The adapter folder points at the base model; a relative path would break from another directory.
    model.peft_config["default"].base_model_name_or_path = str(Path(base).resolve()) if Path(base).is_dir() else base
    return model


@contextmanager
def hidden_model_type(model: torch.nn.Module) -> Iterator[None]:
    """peft rewrites the targets of a model whose config names a transformers v5 mixture of experts: the
    experts' projections become adapters of its own on the fused expert tensors, and the dense and shared
    layers named like them lose theirs. Ours adapts its experts itself (`Experts.add_lora`): while peft wraps
    it, its config names no model type, so peft takes it for the plain module it is."""
    if not isinstance(model, CausalLM):
        yield
        return
    config = model.config
    model.config = SimpleNamespace(**{k: v for k, v in config.to_dict().items() if k != "model_type"})
    try:
        yield
    finally:
        model.config = config


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
    # The experts' own adapters are no peft layers: peft's function would drop them.
    experts = {name: tensor for name, tensor in state_dict.items() if ".mlp.experts.lora_" in name}
    others = {name: tensor for name, tensor in state_dict.items() if name not in experts}
    return {**get_peft_model_state_dict(model, state_dict=others), **split_expert_adapters(experts)}


def merged_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The base weights with the adapter merged in, on rank 0 (others get an empty dict): a plain model, for
    the final SFT result. A collective: every rank must call it."""
    adapter = adapter_state_dict(model)
    if not adapter:
        return {}
    config = adapter_config(model)
    return weights.merge_adapter(weights.base_state_dict(config["base_model_name_or_path"]), adapter, config)
