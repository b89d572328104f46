"""Policy weights on disk: `weights/step_N/` in Hugging Face format, then an empty `STABLE` marker.

The trainer writes into a temporary folder and renames it; `STABLE` is written last, so a reader that
sees the marker sees complete weights. Version N is the policy after trainer step N; version 0 is the
base model.

With LoRA the folder holds only the adapter, in peft's layout (`adapter_model.safetensors`,
`adapter_config.json`, whose `base_model_name_or_path` names the base model). `load_state_dict` merges it
into the base weights, W + (lora_alpha / r) · B @ A, so a reader gets a full state dict either way.
With broadcast transfer (transport/broadcast.py) the folder holds only the marker (`publish_marker`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from asyncrl.write_errors import save_tensors

WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MARKER = "STABLE"


def weights_dir(output_dir: Path, version: int) -> Path:
    return Path(output_dir) / "weights" / f"step_{version}"


def save_model_folder(
    path: Path, state_dict: dict[str, torch.Tensor], config, tokenizer, generation_config=None
) -> Path:
    """Write a complete, loadable Hugging Face model folder (weights, config, tokenizer) atomically: into a
    temporary folder, then renamed. Used for published weights and for the final SFT model."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if getattr(config, "tie_word_embeddings", False):
        # Tied tensors share storage, which safetensors refuses; loaders re-tie them.
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    tensors = {k: v.detach().contiguous() for k, v in state_dict.items()}
    save_tensors(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
    config.save_pretrained(tmp)
    if generation_config is not None:
        generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def publish(output_dir: Path, version: int, state_dict: dict[str, torch.Tensor], config, tokenizer) -> Path:
    """Write policy version `version`; the STABLE marker, written last, tells readers it is complete."""
    final = save_model_folder(weights_dir(output_dir, version), state_dict, config, tokenizer)
    (final / MARKER).touch()
    return final


def publish_marker(output_dir: Path, version: int) -> Path:
    """Mark version `version` published without its weights, which went to inference by broadcast
    (transport/broadcast.py): the folder holds only the STABLE marker."""
    path = weights_dir(output_dir, version)
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).touch()
    return path


def publish_adapter(output_dir: Path, version: int, adapter: dict[str, torch.Tensor], config: dict) -> Path:
    """Write policy version `version` as a LoRA adapter folder (peft's layout), then the STABLE marker."""
    path = weights_dir(output_dir, version)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_tensors(
        {k: v.detach().contiguous() for k, v in adapter.items()}, tmp / ADAPTER_FILE, metadata={"format": "pt"}
    )
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    (path / MARKER).touch()
    return path


def latest_version(output_dir: Path) -> int:
    """Newest version with a STABLE marker; 0 (the base model) when none."""
    root = Path(output_dir) / "weights"
    versions = [0]
    for marker in root.glob(f"step_*/{MARKER}"):
        suffix = marker.parent.name.removeprefix("step_")
        if suffix.isdigit():
            versions.append(int(suffix))
    return max(versions)


def load_state_dict(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The full state dict of a published version, on `device`: its weights, or its adapter merged into the
    base model."""
    path = Path(path)
    if not (path / MARKER).exists():
        raise FileNotFoundError(f"weights folder '{path}' has no {MARKER} marker: it is missing or half-written")
    if (path / ADAPTER_CONFIG).exists():
        config = json.loads((path / ADAPTER_CONFIG).read_text())
        base = base_state_dict(config["base_model_name_or_path"])
        merged = merge_adapter(base, load_file(path / ADAPTER_FILE), config)
        return {name: tensor.to(device) for name, tensor in merged.items()}
    if not (path / WEIGHTS_FILE).exists():
        raise FileNotFoundError(
            f"weights folder '{path}' holds only its {MARKER} marker: that version was sent by broadcast "
            "(weight_transfer.mode = 'broadcast'); update without a path to take it from the broadcast"
        )
    return load_file(path / WEIGHTS_FILE, device=str(device))


@functools.lru_cache(maxsize=1)
def base_state_dict(name: str) -> dict[str, torch.Tensor]:
    """The weights of an adapter's base model (a local folder, or a hub id in the local cache), read once:
    every published version of a LoRA run has the same base. Callers must not modify the tensors."""
    folder = Path(name)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(name, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]))
        except Exception as error:  # noqa: BLE001 - any failure means the same thing here
            raise FileNotFoundError(
                f"base model '{name}' of the adapter is neither a folder nor cached: {error}"
            ) from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"base model folder '{folder}' has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


def merge_adapter(
    base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], config: dict
) -> dict[str, torch.Tensor]:
    """W' = W + (lora_alpha / r) · B @ A for every adapted linear layer; other tensors are the base's own.

    Adapter keys look like `base_model.model.<module>.lora_A.weight`; the base weight is `<module>.weight`.
    """
    unsupported = [
        key
        for key in ("use_dora", "use_rslora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "modules_to_save")
        if config.get(key)
    ]
    if unsupported:
        raise ValueError(f"adapter options {unsupported} are not supported (plain LoRA only)")
    scale = config["lora_alpha"] / config["r"]
    merged = dict(base)
    for key, lora_a in adapter.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        lora_b = adapter[key.replace(".lora_A.", ".lora_B.")]
        weight = base.get(f"{module}.weight")
        if weight is None:
            raise ValueError(f"adapter layer '{module}' has no weight '{module}.weight' in the base model")
        delta = scale * (lora_b.float() @ lora_a.float())
        merged[f"{module}.weight"] = (weight.float() + delta).to(weight.dtype)
    return merged


def prune(output_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` published versions."""
    root = Path(output_dir) / "weights"
    versions = sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*") if p.name[5:].isdigit())
    for version in versions[:-keep]:
        shutil.rmtree(weights_dir(output_dir, version), ignore_errors=True)
