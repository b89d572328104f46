"""Pack rollouts into micro-batches of at most `seq_len` tokens, spread evenly over trainer ranks.

Each micro-batch is one row holding several samples back to back; `position_ids` restart at 0 for each
sample so the trainer's attention keeps samples apart. Every rank gets the same number of micro-batches
(padded with a row that has no loss tokens), because FSDP ranks must run the same number of forward and
backward passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.transport.rollouts import MicroBatch
from asyncrl.transport.routing import unrecorded


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[bool]
    advantage: float
    inference_logprobs: list[float]
    temperature: float
    routed_experts: np.ndarray | None = None  # int16 [tokens, MoE layers, k] (router replay)

    def __len__(self) -> int:
        return len(self.input_ids)

    def truncated(self, seq_len: int) -> Sample:
        return Sample(
            self.input_ids[:seq_len],
            self.loss_mask[:seq_len],
            self.advantage,
            self.inference_logprobs[:seq_len],
            self.temperature,
            self.routed_experts[:seq_len] if self.routed_experts is not None else None,
        )


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices whose lengths sum to at most `capacity`, longest items placed first."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def to_micro_batch(samples: list[Sample]) -> MicroBatch:
    def cat(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    return MicroBatch(
        input_ids=cat([t for s in samples for t in s.input_ids], torch.int64),
        position_ids=cat([p for s in samples for p in range(len(s))], torch.int64),
        loss_mask=cat([m for s in samples for m in s.loss_mask], torch.bool),
        advantages=cat([s.advantage if m else 0.0 for s in samples for m in s.loss_mask], torch.float32),
        inference_logprobs=cat([lp for s in samples for lp in s.inference_logprobs], torch.float32),
        temperature=cat([s.temperature for s in samples for _ in s.input_ids], torch.float32),
        sample_lengths=cat([len(s) for s in samples], torch.int64),
        routed_experts=routed_experts(samples),
    )


def routed_experts(samples: list[Sample]) -> torch.Tensor | None:
    """The row's routing (-1 for samples that carry none), or None when no sample carries any."""
    known = next((s.routed_experts for s in samples if s.routed_experts is not None), None)
    if known is None:
        return None
    parts = [s.routed_experts if s.routed_experts is not None else unrecorded(len(s), known) for s in samples]
    return torch.from_numpy(np.concatenate(parts))


def padding_micro_batch(pad_token_id: int) -> MicroBatch:
    return to_micro_batch([Sample([pad_token_id], [False], 0.0, [0.0], 1.0)])


def pack(samples: list[Sample], seq_len: int, num_ranks: int, pad_token_id: int = 0) -> list[list[MicroBatch]]:
    """Micro-batches per rank: no sample split, none longer than `seq_len` (longer samples are cut)."""
    samples = [s if len(s) <= seq_len else s.truncated(seq_len) for s in samples]
    bins = first_fit_decreasing([len(s) for s in samples], seq_len)
    per_rank: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    # Largest rows first to the least-loaded rank keeps ranks' token counts close.
    for b in sorted(bins, key=lambda b: -sum(len(samples[i]) for i in b)):
        rank = min(range(num_ranks), key=lambda r: (len(per_rank[r]), load[r]))
        per_rank[rank].append(b)
        load[rank] += sum(len(samples[i]) for i in b)
    rows = max(1, max(len(r) for r in per_rank))
    return [
        [to_micro_batch([samples[i] for i in b]) for b in rank_bins]
        + [padding_micro_batch(pad_token_id)] * (rows - len(rank_bins))
        for rank_bins in per_rank
    ]
