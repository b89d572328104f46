"""Document-masked attention for packed rows: each token attends causally within its own sample only.

Transformers' own path for a packed row builds a dense [T x T] block-diagonal mask, and the kernel still
computes the whole row's attention: 32 documents of 2,048 tokens cost as much as one of 65,536. This
attention skips the other documents' work instead, and is exact (tests compare it with each sample run
alone). The kernel (`choose_kernels`, `perf.attention_kernel`):

- a row that is one document, on CUDA in half precision: cuDNN's fused attention through torch's
  scaled-dot-product attention (`"cudnn"`: plain causal attention, no document mask needed). On Hopper it
  runs long causal rows ~1.8x faster than flash attention (one H200, bf16, 16 query / 8 KV heads x 128,
  forward + backward: 573 against 328 TFLOP/s at 65,536 tokens). `auto` takes it from
  `CUDNN_MIN_TOKENS` tokens on, once a start-up check (`cudnn_attention_problem`) has run it on the
  model's head shape; cuDNN plans every new shape anew, which short rows of changing lengths would pay;
- a packed row on CUDA: varlen flash attention (`torch.nn.attention.varlen`) over the documents'
  cumulative lengths (`"varlen"`), or, where this torch lacks it, flex attention with a document block
  mask (`"flex"`);
- on CPU, and for float32 on CUDA (flash and cuDNN take half precision only): scaled-dot-product attention
  per document (`"sdpa"`; flex attention has no backward on CPU).

It is registered with transformers' `AttentionInterface` under `DOCUMENT_ATTENTION`, so any model that
dispatches through that interface (Llama, Qwen, ...) uses it when loaded with that implementation name;
transformers then builds no mask at all, and the document boundaries travel as the `documents` keyword
argument of the model's forward (`attention_kwargs`), which it hands down to every attention layer.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers import AttentionInterface, PreTrainedModel

from asyncrl.errors import AsyncRLError

log = logging.getLogger(__name__)

DOCUMENT_ATTENTION = "asyncrl_document"
# `auto` runs one-document rows through cuDNN from this length on. At 8,192 tokens cuDNN saves ~1.3 ms of a
# layer's forward + backward on an H200 (Qwen3-0.6B heads); below a few thousand tokens the saving is small
# next to a new shape's planning, which a row of a new length pays.
CUDNN_MIN_TOKENS = 4096
# cuDNN first, flash where cuDNN turns the inputs down: the call never fails for want of a kernel.
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]


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


@dataclass(frozen=True)
class AttentionKernels:
    """The kernels document attention runs: `packed` for a row of several documents, `one_document` for a row
    that is one document of at least `one_document_min_tokens` tokens (shorter ones take `packed`'s)."""

    one_document: str  # "cudnn" | "varlen" | "flex" | "sdpa"
    packed: str  # "varlen" | "flex" | "sdpa"
    one_document_min_tokens: int = 1

    def for_row(self, lengths: list[int]) -> str:
        if len(lengths) == 1 and lengths[0] >= self.one_document_min_tokens:
            return self.one_document
        return self.packed


def choose_kernels(choice: str, on_cuda: bool, varlen: bool, cudnn_problem: str | None) -> AttentionKernels:
    """`perf.attention_kernel` resolved for a device: `on_cuda`, whether this torch has varlen flash attention,
    and why cuDNN's attention cannot serve the model (None: it can).

    auto: cuDNN for one-document rows of `CUDNN_MIN_TOKENS` tokens or more (varlen flash where cuDNN failed
    its check, with a warning), varlen flash for packed rows (flex without it); sdpa per document on a CPU.
    cudnn: cuDNN for every one-document row, varlen (or flex) for packed rows. flash: varlen flash for all
    rows. flex: flex attention for all rows. sdpa: scaled-dot-product attention per document, any device.
    A kernel the device cannot run is an error naming the fix."""
    if choice == "sdpa" or (choice == "auto" and not on_cuda):
        return AttentionKernels("sdpa", "sdpa")
    if not on_cuda:
        raise AsyncRLError(f"perf.attention_kernel = '{choice}' needs a CUDA GPU (use 'auto' or 'sdpa' on a CPU)")
    packed = "varlen" if varlen else "flex"
    if choice == "flex":
        return AttentionKernels("flex", "flex")
    if choice == "flash":
        if not varlen:
            raise AsyncRLError(
                "perf.attention_kernel = 'flash' needs torch's varlen flash attention (torch >= 2.11; use 'auto')"
            )
        return AttentionKernels("varlen", "varlen")
    if choice == "cudnn":
        if cudnn_problem is not None:
            raise AsyncRLError(
                f"perf.attention_kernel = 'cudnn': cuDNN's attention cannot serve this model ({cudnn_problem}) "
                "(use 'auto' or 'flash')"
            )
        return AttentionKernels("cudnn", packed)
    if cudnn_problem is not None:
        log.warning("cuDNN attention is not used (%s); one-document rows take %s", cudnn_problem, packed)
        return AttentionKernels(packed, packed)
    return AttentionKernels("cudnn", packed, CUDNN_MIN_TOKENS)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else 'no message'}"


@functools.cache
def cudnn_attention_problem(device: torch.device, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """None when cuDNN's fused attention runs a causal forward and backward of this head shape (bf16) and
    matches float32 attention; otherwise why not, in one line. Run once per shape and device."""
    if device.type != "cuda":
        return "not a CUDA device"
    if not torch.backends.cudnn.is_available():
        return "torch has no cuDNN"
    generator = torch.Generator(device).manual_seed(0)
    tokens = 512

    def random(*shape):
        return torch.randn(*shape, device=device, generator=generator)

    q, upstream = random(1, heads, tokens, head_dim), random(1, heads, tokens, head_dim)
    k, v = random(1, kv_heads, tokens, head_dim), random(1, kv_heads, tokens, head_dim)

    def run(dtype: torch.dtype, backends: list[SDPBackend]) -> list[torch.Tensor]:
        inputs = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        with torch.enable_grad(), sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(*inputs, is_causal=True, enable_gqa=True)
            (out.float() * upstream).sum().backward()
        return [out.detach().float(), *(t.grad.float() for t in inputs)]

    try:
        fused = run(torch.bfloat16, [SDPBackend.CUDNN_ATTENTION])
    except Exception as error:  # noqa: BLE001 - any failure means: do not use it
        return _first_line(error)
    reference = run(torch.float32, [SDPBackend.MATH])
    error = max(float((x - r).norm() / r.norm()) for x, r in zip(fused, reference))
    if not error < 0.02:  # bf16 attention is off by ~3e-3 relative; also catches NaN
        return f"its output or gradients are off by {error:.1e} (relative) against float32 attention"
    return None


def model_kernels(model: PreTrainedModel, choice: str) -> AttentionKernels:
    """`choose_kernels` for a model already on its device (cuDNN checked on its head shape when it matters)."""
    device = next(model.parameters()).device
    on_cuda = device.type == "cuda"
    problem = None
    if on_cuda and choice in ("auto", "cudnn"):
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
        problem = cudnn_attention_problem(device, heads, kv_heads, head_dim)
    return choose_kernels(choice, on_cuda, VARLEN_ATTN is not None, problem)


def unchecked_kernels(device: torch.device) -> AttentionKernels:
    """The kernels of a model `prepare_model` did not set up: `auto`'s without cuDNN (which needs its check)."""
    if device.type != "cuda":
        return AttentionKernels("sdpa", "sdpa")
    packed = "varlen" if VARLEN_ATTN is not None else "flex"
    return AttentionKernels(packed, packed)


@dataclass
class Documents:
    """Where the samples of one packed row start and end, and the kernel that attends within them."""

    cu_seqlens: torch.Tensor  # int32 [D + 1]: 0, end of sample 1, end of sample 2, ..., T
    lengths: list[int]
    # The longest sample rounded up to a power of two: varlen sizes its grid by it, and a compiled layer
    # (which specializes on this int) then recompiles for a handful of values, not for every packing.
    padded_longest: int
    kernel: str  # "cudnn" | "varlen" | "flex" (CUDA) | "sdpa"
    block_mask: object | None = None  # flex attention's BlockMask

    @classmethod
    def from_position_ids(
        cls, position_ids: torch.Tensor, kernels: AttentionKernels | None = None, kernel: str | None = None
    ) -> Documents:
        """A sample starts wherever the position does not follow the previous one (as transformers reads it).
        The kernel: `kernel` if given, else the one `kernels` (default: `unchecked_kernels`) takes for it."""
        starts = torch.ones_like(position_ids, dtype=torch.bool)
        starts[1:] = position_ids[1:] != position_ids[:-1] + 1
        start_index = starts.nonzero().flatten()
        total = torch.tensor([position_ids.numel()], device=position_ids.device)
        cu_seqlens = torch.cat([start_index, total]).to(torch.int32)
        lengths = cu_seqlens.diff().tolist()
        padded_longest = min(1 << (max(lengths) - 1).bit_length(), position_ids.numel())
        if kernel is None:
            kernel = (kernels or unchecked_kernels(position_ids.device)).for_row(lengths)
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
    half = query.dtype in (torch.float16, torch.bfloat16)
    # cuDNN and flash (varlen) take half precision only; a float32 run on CUDA attends per document below.
    if documents.kernel == "cudnn" and half:
        return one_document_attention(query, key, value, scaling), None
    if documents.kernel == "varlen" and half:
        return varlen_document_attention(query, key, value, documents, scaling), None
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


def one_document_attention(query, key, value, scaling: float | None) -> torch.Tensor:
    """Plain causal attention over the whole row (it is one document), cuDNN's kernel first: [1, T, Hq, D]."""
    with sdpa_kernel(CUDNN_FIRST):
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2)


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


def uses_document_attention(model: torch.nn.Module) -> bool:
    """Whether the model attends with `document_attention`: ours once the trainer prepared it (also inside the
    context-parallel exchange, `models/context_parallel.py`), or a transformers model loaded with
    `DOCUMENT_ATTENTION`."""
    attention = getattr(model, "attention", None)
    return (
        attention is not None and inspect.unwrap(attention) is document_attention
    ) or model.config._attn_implementation == DOCUMENT_ATTENTION


def attention_kwargs(model: PreTrainedModel, position_ids: torch.Tensor) -> dict:
    """Extra forward arguments for one packed row: its document boundaries when the model runs document
    attention (with the kernels `prepare_model` chose for it); none otherwise (transformers then masks from
    `position_ids` itself)."""
    if not uses_document_attention(model):
        return {}
    return {"documents": Documents.from_position_ids(position_ids, getattr(model, "attention_kernels", None))}


AttentionInterface.register(DOCUMENT_ATTENTION, document_attention)
