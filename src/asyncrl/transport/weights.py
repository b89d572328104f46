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
# Files copied next to the weights so that a weights folder is a complete, loadable model.
_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def weights_dir(output_dir: Path, version: int) -> Path:
    return Path(output_dir) / "weights" / f"step_{version}"


def publish(output_dir: Path, version: int, state_dict: dict[str, torch.Tensor], config, source: str | Path) -> Path:
    """Write version `version` atomically. `config` is the model's PretrainedConfig; `source` the model folder
    whose tokenizer files are copied alongside (skipped when it is a hub id)."""
    final = weights_dir(output_dir, version)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if getattr(config, "tie_word_embeddings", False):
        # Tied tensors share storage, which safetensors refuses; the loader re-ties them.
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    save_file({k: v.detach().contiguous() for k, v in state_dict.items()}, tmp / WEIGHTS_FILE)
    config.save_pretrained(tmp)
    source = Path(source)
    for name in _SIDE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, tmp / name)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
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
