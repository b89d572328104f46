"""Document-masked attention for packed rows: each token attends causally within its own sample only.

Transformers' own path for a packed row builds a dense [T x T] block-diagonal mask, and the kernel still
computes the whole row's attention: 32 documents of 2,048 tokens cost as much as one of 65,536 (NOTES.md).
This attention skips the other documents' work instead, and is exact (tests compare it with each sample
run alone):

- on CUDA: varlen flash attention (`torch.nn.attention.varlen`) over the documents' cumulative lengths,
  or, where this torch lacks it, flex attention with a document block mask;
- on CPU, and for float32 on CUDA (flash takes half precision only): scaled-dot-product attention per
  document (flex attention has no backward on CPU).

It is registered with transformers' `AttentionInterface` under `DOCUMENT_ATTENTION`, so any model that
dispatches through that interface (Llama, Qwen, ...) uses it when loaded with that implementation name;
transformers then builds no mask at all, and the document boundaries travel as the `documents` keyword
argument of the model's forward (`attention_kwargs`), which it hands down to every attention layer.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers import AttentionInterface, PreTrainedModel

DOCUMENT_ATTENTION = "asyncrl_document"


def _find_varlen_attn():
    """torch's varlen flash attention, in the form that takes `scale` and `window_size` (torch 2.11+)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if {"scale", "window_size"} <= inspect.signature(varlen_attn).parameters.keys() else None


# Resolved once here, not inside the attention call, which a compiled layer traces.
VARLEN_ATTN = _find_varlen_attn()
VARLEN_TAKES_GQA = VARLEN_ATTN is not None and "enable_gqa" in inspect.signature(VARLEN_ATTN).parameters
FLEX_ATTENTION = torch.compile(flex_attention)  # flex attention is only fast compiled; compiles on first call


@dataclass
class Documents:
    """Where the samples of one packed row start and end, and the kernel that attends within them."""

    cu_seqlens: torch.Tensor  # int32 [D + 1]: 0, end of sample 1, end of sample 2, ..., T
    lengths: list[int]
    # The longest sample rounded up to a power of two: varlen sizes its grid by it, and a compiled layer
    # (which specializes on this int) then recompiles for a handful of values, not for every packing.
    padded_longest: int
    kernel: str  # "varlen" | "flex" (CUDA) | "sdpa" (CPU)
    block_mask: object | None = None  # flex attention's BlockMask

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor, kernel: str | None = None) -> Documents:
        """A sample starts wherever the position does not follow the previous one (as transformers reads it).
        The kernel: varlen on CUDA where torch has it, else flex; sdpa per document on CPU."""
        starts = torch.ones_like(position_ids, dtype=torch.bool)
        starts[1:] = position_ids[1:] != position_ids[:-1] + 1
        start_index = starts.nonzero().flatten()
        total = torch.tensor([position_ids.numel()], device=position_ids.device)
        cu_seqlens = torch.cat([start_index, total]).to(torch.int32)
        lengths = cu_seqlens.diff().tolist()
        padded_longest = min(1 << (max(lengths) - 1).bit_length(), position_ids.numel())
        if kernel is None:
            on_cuda = position_ids.device.type == "cuda"
            kernel = ("varlen" if VARLEN_ATTN is not None else "flex") if on_cuda else "sdpa"
        documents = cls(cu_seqlens, lengths, padded_longest, kernel)
        if kernel == "flex":
            documents.block_mask = document_block_mask(starts.cumsum(0) - 1)
        return documents


def document_block_mask(document_id: torch.Tensor):
    """Flex attention's block mask: causal within a document; blocks wholly outside every document are skipped."""

    def same_document_causal(batch, head, q_index, kv_index):
        return (document_id[q_index] == document_id[kv_index]) & (q_index >= kv_index)

    length = document_id.numel()
    return create_block_mask(same_document_causal, None, None, length, length, device=document_id.device)


def document_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    documents: Documents | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [1, T, Hq, D]."""
    if documents is None:
        raise ValueError(
            f"attention '{DOCUMENT_ATTENTION}' needs the row's document boundaries: call the model with "
            "**attention_kwargs(model, position_ids)"
        )
    if query.shape[0] != 1 or dropout:
        raise ValueError(f"attention '{DOCUMENT_ATTENTION}' takes one packed row and no dropout")
    if documents.kernel == "varlen" and query.dtype in (torch.float16, torch.bfloat16):
        return varlen_document_attention(query, key, value, documents, scaling), None
    # Flash (varlen) takes half precision only; a float32 run on CUDA attends per document below.
    if documents.kernel == "flex":
        out = FLEX_ATTENTION(query, key, value, block_mask=documents.block_mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None
    pieces = [
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        for q, k, v in zip(
            query.split(documents.lengths, dim=2),
            key.split(documents.lengths, dim=2),
            value.split(documents.lengths, dim=2),
        )
    ]
    return torch.cat(pieces, dim=2).transpose(1, 2), None


def varlen_document_attention(query, key, value, documents: Documents, scaling: float | None) -> torch.Tensor:
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    gqa = {}
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves a group of query heads
        if VARLEN_TAKES_GQA:
            gqa = {"enable_gqa": True}
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    longest = documents.padded_longest
    # window (-1, 0): no limit to the left, nothing to the right: causal.
    out = VARLEN_ATTN(
        q, k, v, documents.cu_seqlens, documents.cu_seqlens, longest, longest, scale=scaling, window_size=(-1, 0), **gqa
    )
    return out[None]


def attention_kwargs(model: PreTrainedModel, position_ids: torch.Tensor) -> dict:
    """Extra forward arguments for one packed row: its document boundaries when the model runs
    `DOCUMENT_ATTENTION`; none otherwise (transformers then masks from `position_ids` itself)."""
    if model.config._attn_implementation != DOCUMENT_ATTENTION:
        return {}
    return {"documents": Documents.from_position_ids(position_ids)}


AttentionInterface.register(DOCUMENT_ATTENTION, document_attention)
