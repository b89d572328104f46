"""Policy weights on disk: `weights/step_N/` in Hugging Face format, then an empty `STABLE` marker.

The trainer writes into a temporary folder and renames it; `STABLE` is written last, so a reader that
sees the marker sees complete weights. Version N is the policy after trainer step N; version 0 is the
base model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_FILE = "model.safetensors"
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
    save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
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


def latest_version(output_dir: Path) -> int:
    """Newest version with a STABLE marker; 0 (the base model) when none."""
    root = Path(output_dir) / "weights"
    versions = [0]
    for marker in root.glob(f"step_*/{MARKER}"):
        suffix = marker.parent.name.removeprefix("step_")
        if suffix.isdigit():
            versions.append(int(suffix))
    return max(versions)


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not (path / MARKER).exists():
        raise FileNotFoundError(f"weights folder '{path}' has no {MARKER} marker: it is missing or half-written")
    return load_file(path / WEIGHTS_FILE)


def prune(output_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` published versions."""
    root = Path(output_dir) / "weights"
    versions = sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*") if p.name[5:].isdigit())
    for version in versions[:-keep]:
        shutil.rmtree(weights_dir(output_dir, version), ignore_errors=True)
