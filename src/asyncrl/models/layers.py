"""The pieces of a decoder layer every family shares: RMS norm, rotary embeddings, attention, the SwiGLU MLP.

Each follows transformers' operations in transformers' order and dtypes (the norm in float32, cast back,
then times its weight; rotary tables in the activations' dtype), so our logits match theirs to rounding.
Attention itself is a function handed in by the caller with transformers' attention signature: the trainer
gives document attention (`trainer/attention.py`), which keeps packed samples apart; by default it is plain
causal attention over the whole row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# transformers' attention interface: (module, query, key, value, mask, scaling=..., **kwargs) -> (out, weights),
# query [batch, heads, T, dim], key/value [batch, kv heads, T, dim]; out [batch, T, heads, dim].
AttentionFunction = Callable[..., tuple[torch.Tensor, Any]]


def causal_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Causal attention over the whole row (no packed samples): the default `AttentionFunction`."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


class RMSNorm(nn.Module):
    """x / rms(x) in float32, cast back to x's dtype, times the weight (`variance_epsilon` as transformers
    names it, which the engine reads)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normalized = F.rms_norm(x.float(), (x.shape[-1],), eps=self.variance_epsilon)
        return self.weight * normalized.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the first cos.shape[-1] dimensions of each head (all of them but for families with
    partial rotary embeddings, whose other dimensions pass through)."""
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rotated, passed = x[..., :width], x[..., width:]
    return torch.cat((rotated * cos + rotate_half(rotated) * sin, passed), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention: q/k/v projections (with or without bias), optional q/k RMS norms over each head
    (Qwen3), rotary embeddings, then `attention`, then the output projection."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        qkv_bias: bool,
        output_bias: bool,
        qk_norm: bool,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=output_bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFunction, **attention_kwargs
    ) -> torch.Tensor:
        """x [batch, T, hidden]; cos, sin [batch, T, rotary dims]."""
        heads = (*x.shape[:-1], -1, self.head_dim)
        q, k, v = self.q_proj(x).view(heads), self.k_proj(x).view(heads), self.v_proj(x).view(heads)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [batch, heads, T, dim]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out, _ = attention(self, q, k, v, None, scaling=self.scaling, dropout=0.0, **attention_kwargs)
        return self.o_proj(out.reshape(*x.shape[:-1], -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); also a family's shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
