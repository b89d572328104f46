"""Read an offline W&B run's records (the `run-<id>.wandb` file: LevelDB's log format, 32 KiB blocks of
checksummed chunks, each a piece of one protobuf `Record`), for tests that check what a run logged."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

HEADER = 7  # ":W&B", a 2-byte magic, a version byte
BLOCK = 32 * 1024
CHUNK_HEADER = 7  # crc32 (4), length (2), type (1): 1 whole, 2 first, 3 middle, 4 last


def records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pending, position = [], b"", HEADER
    while position + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < CHUNK_HEADER:  # the block's tail is padding
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + CHUNK_HEADER])
        chunk = data[position + CHUNK_HEADER : position + CHUNK_HEADER + length]
        position += CHUNK_HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(run_dir: Path) -> list[dict]:
    """Each `run.log` row of the offline run in `run_dir` (the folder holding `run-<id>.wandb`)."""
    (path,) = run_dir.glob("run-*.wandb")
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


def config(run_dir: Path) -> dict:
    """The run's config: given to `wandb.init` (the run record) and updated later (config records)."""
    (path,) = run_dir.glob("run-*.wandb")
    values = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        values |= {item.key: json.loads(item.value_json) for item in updates}
    return values
