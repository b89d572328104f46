"""Context parallelism, Ulysses-style (DeepSpeed-Ulysses, Jacobs et al. 2023): the `cp` ranks of a group split
each row's tokens into contiguous slices, one per rank, and run everything but attention (embeddings, norms,
projections, MLPs or experts, the LM head) on their own slice. Around attention an all-to-all swaps sequence
slices for head slices: each rank then holds the WHOLE row for H / cp query heads and H_kv / cp KV heads, so
document attention over a packed row (`trainer/attention.py`) runs unchanged, and the inverse all-to-all brings
its output back to sequence slices. Autograd runs the same exchanges backwards.

Heads are never replicated: the KV heads must divide by `cp` (`check_heads`), so each rank's query heads and
the KV heads they read land on the same rank. A model with fewer KV heads than `cp` is refused (replicating
them would send cp / H_kv copies of every KV head through the all-to-all and sum their gradients back).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.errors import AsyncRLError
from asyncrl.models.expert_parallel import all_to_all
from asyncrl.models.layers import AttentionFunction


@dataclass(frozen=True)
class ContextParallel:
    """One rank's place in its context-parallel group: `size` ranks that hold the same rows, each a slice."""

    group: dist.ProcessGroup
    rank: int
    size: int

    def padded(self, tokens: int) -> int:
        """A row's length rounded up to a multiple of `size`: every rank gets a slice of the same length."""
        return -(-tokens // self.size) * self.size

    def own(self, tokens: int) -> slice:
        """This rank's slice of a row padded to `padded(tokens)` tokens."""
        width = self.padded(tokens) // self.size
        return slice(self.rank * width, (self.rank + 1) * width)


def check_heads(num_heads: int, num_kv_heads: int, cp: int) -> None:
    if num_heads % cp or num_kv_heads % cp:
        raise AsyncRLError(
            f"trainer.cp = {cp} splits the attention heads between the ranks of a context-parallel group, and the "
            f"model has {num_heads} query and {num_kv_heads} KV heads: cp must divide both (set trainer.cp to a "
            "divisor of the KV heads)"
        )


@torch.compiler.disable  # a collective, not a graph
def _sequence_to_heads(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[1, H, T / cp, D] (all heads, this rank's slice) -> [1, H / cp, T, D] (this rank's heads, the whole row)."""
    heads, width, dim = x.shape[1:]
    blocks = x[0].reshape(cp.size, heads // cp.size, width, dim)  # block j: the heads rank j attends with
    received = all_to_all(blocks, [1] * cp.size, [1] * cp.size, cp.group)  # block i: rank i's slice
    return received.transpose(0, 1).reshape(heads // cp.size, cp.size * width, dim)[None]


@torch.compiler.disable
def _heads_to_sequence(out: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[1, T, H / cp, D] (attention's output layout) -> [1, T / cp, H, D]: the inverse exchange."""
    tokens, heads, dim = out.shape[1:]
    blocks = out[0].reshape(cp.size, tokens // cp.size, heads, dim)  # block i: rank i's slice
    received = all_to_all(blocks, [1] * cp.size, [1] * cp.size, cp.group)  # block j: rank j's heads
    return received.transpose(0, 1).reshape(tokens // cp.size, cp.size * heads, dim)[None]


def ulysses_attention(attention: AttentionFunction, cp: ContextParallel) -> AttentionFunction:
    """`attention` (transformers' signature) over the whole row, called on this rank's slice of it. Its keyword
    arguments (the document boundaries) describe the whole row."""

    @functools.wraps(attention)  # `inspect.unwrap` finds the attention inside (`uses_document_attention`)
    def wrapped(module, query, key, value, attention_mask, **kwargs):
        query, key, value = (_sequence_to_heads(t, cp) for t in (query, key, value))
        out, weights = attention(module, query, key, value, attention_mask, **kwargs)
        return _heads_to_sequence(out, cp), weights

    return wrapped


class _GatherSlices(torch.autograd.Function):
    """The whole row of a per-token stream from every rank's slice (last dimension). Every rank of the group
    computes the same loss from the whole row, so each one's gradient for its own slice is already the whole
    gradient there: the backward keeps its slice and sends nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp, ctx.width = cp, x.shape[-1]
        pieces = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(pieces, x.contiguous(), group=cp.group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.cp.rank * ctx.width
        return grad[..., start : start + ctx.width], None


def gather_slices(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[..., T / cp] on each rank of the group -> [..., T] on every one (`_GatherSlices`)."""
    return _GatherSlices.apply(x, cp)
