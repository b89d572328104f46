"""Rows of data from files and Hugging Face datasets, and the order they are trained on.

`load_rows` reads JSONL or Parquet files, a folder (one written by `Dataset.save_to_disk`, or a folder of data
files) or a Hugging Face hub id, all through the `datasets` library. `epoch_order` says which row comes when:
every epoch is a fresh permutation drawn from the seed, so the same seed gives the same order. SFT
(`trainer/sft.py`) and the `dataset` environment both read their data this way.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncrl.errors import AsyncRLError

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _quiet_datasets():
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def load_rows(path: str | list[str], split: str = "train", subset: str | None = None) -> Any:
    """A `datasets.Dataset` (indexable, with `len`) of one split.

    `path`: a .jsonl/.json/.parquet file or a list of them (their rows in order, as one split); a local
    folder; or a hub id (needs the network, or a copy in the Hugging Face cache).
    """
    datasets = _quiet_datasets()
    paths = [path] if isinstance(path, str) else list(path)
    if not paths:
        raise AsyncRLError("no data path given (set it to a .jsonl or .parquet file, a folder or a hub id)")
    try:
        if all(Path(p).suffix in FORMATS for p in paths):
            missing = [p for p in paths if not Path(p).is_file()]
            if missing:
                raise AsyncRLError(f"data file '{missing[0]}' not found")
            formats = {FORMATS[Path(p).suffix] for p in paths}
            if len(formats) > 1:
                raise AsyncRLError(f"data files {paths} mix formats; give files of one format")
            return datasets.load_dataset(formats.pop(), data_files=[str(p) for p in paths], split="train")
        if len(paths) > 1:
            raise AsyncRLError(f"data paths {paths}: a list may hold .jsonl or .parquet files only")
        folder = Path(paths[0]).expanduser()
        if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
            loaded = datasets.load_from_disk(str(folder))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise AsyncRLError(f"dataset '{folder}' has splits {list(loaded)}, not '{split}' (set split)")
                return loaded[split]
            return loaded
        if not folder.exists() and (paths[0].startswith((".", "/", "~")) or paths[0].count("/") > 1):
            raise AsyncRLError(f"data path '{paths[0]}' not found (a file, a folder, or a hub id 'owner/name')")
        return datasets.load_dataset(str(folder) if folder.exists() else paths[0], subset, split=split)
    except AsyncRLError:
        raise
    except Exception as e:  # noqa: BLE001 - `datasets` raises many types; the user fixes the path or split
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        where = "" if any(Path(p).exists() for p in paths) else " (a hub id needs the network or a cached copy)"
        raise AsyncRLError(f"data '{paths[0]}' could not be loaded: {reason}{where}") from None


def epoch_order(size: int, seed: int, epochs: int | None, shuffle: bool = True) -> Iterator[int]:
    """Row indices, epoch after epoch: each epoch every row once, in a new seeded order (or in file order
    without `shuffle`). `epochs` None: endless."""
    rng = random.Random(seed)
    epoch = 0
    while size and (epochs is None or epoch < epochs):
        order = list(range(size))
        if shuffle:
            rng.shuffle(order)
        yield from order
        epoch += 1


def clean_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the chat template expects it. Columnar formats (Parquet, Arrow) give every message
    every key any message has, the missing ones as None: those are dropped; a missing `content` is ""."""
    cleaned = {key: value for key, value in message.items() if value is not None}
    cleaned.setdefault("content", "")
    return cleaned


def as_messages(value: Any, role: str, column: str) -> list[dict[str, Any]]:
    """A column's value as chat messages: a string is one message of `role`; a list is messages already."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        return [clean_message(m) for m in value]
    raise AsyncRLError(f"column '{column}' holds {type(value).__name__}; expected a string or a list of messages")


def as_tools(value: Any) -> list[dict] | None:
    """A `tools` column: a list of JSON schemas, or that list as a JSON string."""
    if value is None or value == "":
        return None
    return json.loads(value) if isinstance(value, str) else list(value)
