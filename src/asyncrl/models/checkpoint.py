"""Our models in and out of the Hugging Face checkpoint layout, unchanged: a folder transformers and vLLM load.

Reading: the folder's safetensors files (one, or the shards its index lists) straight into a model built on
the meta device, through the family's `from_checkpoint` (MoE: one matrix per expert fused into 3-D tensors),
so no second copy of the weights is ever made. Writing: `to_checkpoint` the other way (views, no copies).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, GenerationConfig, PretrainedConfig, PreTrainedModel

from asyncrl.errors import AsyncRLError
from asyncrl.models.family import StateDict
from asyncrl.models.registry import family_of, native_problem
from asyncrl.models.transformer import CausalLM

INDEX_FILE = "model.safetensors.index.json"


def model_folder(name: str) -> Path:
    """A local folder, or the cached snapshot of a hub id (never downloaded here)."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as error:  # noqa: BLE001 - any failure means the same thing here
        raise AsyncRLError(f"model '{name}' is neither a folder nor in the Hugging Face cache ({error})") from None


def weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        return sorted({folder / shard for shard in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise AsyncRLError(
            f"model folder '{folder}' holds no .safetensors weights (our implementation reads only those)"
        )
    return files


def read_checkpoint(folder: Path, device: torch.device | str) -> StateDict:
    state: StateDict = {}
    for file in weight_files(folder):
        with safe_open(file, framework="pt", device=str(device)) as reader:
            for name in reader.keys():
                state[name] = reader.get_tensor(name)
    return state


def cast(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Floating parameters and buffers to `dtype`, but for the modules a family keeps in float32 (GLM's router)."""
    for module in model.modules():
        keep = getattr(module, "keep_float32", False)
        for tensors in (module._parameters, module._buffers):
            for tensor in tensors.values():
                if tensor is not None and tensor.is_floating_point():
                    tensor.data = tensor.data.to(torch.float32 if keep else dtype)
    return model


def assign(model: CausalLM, state: StateDict, origin: str) -> CausalLM:
    """Load `state` (in-memory layout) into a model built on the meta device, taking the tensors as they are."""
    if model.spec.tie_word_embeddings:
        state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        parts = [
            f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
            for label, names in (("missing", missing), ("unexpected", unexpected))
            if names
        ]
        raise AsyncRLError(f"weights of {origin} do not fit its config.json ({'; '.join(parts)})")
    model.load_state_dict(state, assign=True)
    if model.spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def rebuild_rotary(model: CausalLM, device: torch.device | str) -> None:
    """The rotary tables are not in the checkpoint (transformers keeps them as non-persistent buffers): made anew
    on the model's device."""
    family = family_of(model.config)
    with torch.device(device):
        model.model.rotary_emb = family.rotary(model.config)


def load_native(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
    """A registered family's model from a Hugging Face folder (or cached hub id), on `device` in `dtype`."""
    folder = model_folder(name)
    config = AutoConfig.from_pretrained(folder)
    problem = native_problem(config)
    if problem:
        raise AsyncRLError(f"model '{name}' has no native implementation: {problem} (set model.impl = 'hf')")
    family = family_of(config)
    model = family.build(config, "meta")
    state = family.from_checkpoint(read_checkpoint(folder, device), config)
    cast(assign(model, state, f"model '{name}'"), dtype)
    rebuild_rotary(model, device)
    model.name_or_path = name
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:
        model.generation_config = None
    return model


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def from_config(
    config: PretrainedConfig, device: torch.device | str, dtype: torch.dtype, std: float = 0.02
) -> CausalLM:
    """A registered family's model with random weights (benchmarks: a folder holding only config.json will do),
    made in `dtype` directly: a 30B model's float32 copy would not fit beside it."""
    problem = native_problem(config)
    if problem:
        raise AsyncRLError(f"this model has no native implementation: {problem}")
    with default_dtype(dtype):
        model = family_of(config).build(config, device)
    model.init_weights(std)
    return cast(model, dtype)


def from_transformers(hf_model: PreTrainedModel) -> CausalLM:
    """Our model holding a transformers model's very tensors (no copy): their in-memory names are ours."""
    config = hf_model.config
    problem = native_problem(config)
    if problem:
        raise AsyncRLError(f"{type(hf_model).__name__} has no native implementation: {problem}")
    model = family_of(config).build(config, "meta")
    assign(model, dict(hf_model.state_dict(keep_vars=True)), type(hf_model).__name__)
    model.model.rotary_emb = hf_model.model.rotary_emb
    model.name_or_path = hf_model.name_or_path
    model.generation_config = getattr(hf_model, "generation_config", None)
    return model


def checkpoint_state_dict(config: PretrainedConfig, state: StateDict) -> StateDict:
    """An in-memory state dict in the family's checkpoint layout (unchanged for unregistered families)."""
    family = family_of(config)
    return state if family is None else family.to_checkpoint(state, config)


def in_memory_state_dict(config: PretrainedConfig, state: StateDict) -> StateDict:
    """A checkpoint-layout state dict (a published folder, a broadcast) in the layout our models hold."""
    family = family_of(config)
    return state if family is None else family.from_checkpoint(state, config)
