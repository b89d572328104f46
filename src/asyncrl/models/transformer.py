"""The decoder every registered family is: embeddings → pre-norm layers (attention, then a dense MLP or a
mixture of experts) → final norm → LM head. A family (`registry.py`) says which options its config sets.

The module tree and parameter names are transformers' (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`,
`model.layers.N.mlp.experts.gate_up_proj`, `lm_head`, ...), so a transformers model's state dict loads into
ours unchanged and the trainer, LoRA (peft) and the engine find the layers where they look for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from transformers import GenerationConfig, PretrainedConfig

from asyncrl.models.layers import MLP, Attention, AttentionFunction, RMSNorm, causal_attention
from asyncrl.models.moe import MoE, MoESpec


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    intermediate_size: int  # of the dense MLP layers
    tie_word_embeddings: bool
    qkv_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    moe: MoESpec | None = None
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is `moe`


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, index: int):
        super().__init__()
        self.self_attn = Attention(
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.rms_norm_eps,
            spec.qkv_bias,
            spec.output_bias,
            spec.qk_norm,
        )
        self.is_moe = index in spec.moe_layers
        self.mlp = (
            MoE(spec.hidden_size, spec.moe)
            if self.is_moe
            else MLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)
        )
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFunction,
        replay: torch.Tensor | None = None,
        routing_mask: torch.Tensor | None = None,
        **attention_kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the new residual stream and, for a mixture-of-experts layer, its routing summary (of the
        tokens of `routing_mask` where given)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention, **attention_kwargs)
        h = self.post_attention_layernorm(x)
        if not self.is_moe:
            return x + self.mlp(h), None
        out, summary = self.mlp(h, replay, routing_mask)
        return x + out, summary


class Decoder(nn.Module):
    """transformers' `model.model`: embeddings, layers, final norm, rotary embedding."""

    def __init__(self, spec: DecoderSpec, rotary: nn.Module):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, index) for index in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary_emb = rotary


class CausalLMOutput(NamedTuple):
    """A NamedTuple, so FSDP2 (which walks a forward's outputs as a pytree to hook the backward) sees its tensors:
    with a dataclass, torch 2.11's FSDP2 (not 2.13's) never ran its backward hooks: no gradient reached the
    optimizer and no weight changed."""

    logits: torch.Tensor  # [batch, T, vocab]; the hidden states once the trainer defers the LM head
    routing: torch.Tensor | None  # [MoE layers, 2 + 2E] routing summaries (moe.summarize); None for dense models


class CausalLM(nn.Module):
    """A causal LM of a registered family. `attention` is the attention function every layer calls (the trainer
    sets document attention); `forward(input_ids, position_ids, **attention_kwargs)` takes transformers'
    arguments, so the trainer calls it as it calls a transformers model."""

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, rotary: Callable[[], nn.Module]):
        super().__init__()
        self.config = config
        self.spec = spec
        self.name_or_path = getattr(config, "_name_or_path", "")
        self.generation_config: GenerationConfig | None = None
        self.model = Decoder(spec, rotary())
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attention: AttentionFunction = causal_attention

    # transformers' accessors, which the trainer, peft and the engine use
    def get_decoder(self) -> Decoder:
        return self.model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, head: nn.Module) -> None:
        self.lm_head = head

    @property
    def moe_layers(self) -> list[int]:
        return list(self.spec.moe_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        routed_experts: torch.Tensor | None = None,
        use_cache: bool = False,
        routing_mask: torch.Tensor | None = None,
        **attention_kwargs,
    ) -> CausalLMOutput:
        """input_ids, position_ids [batch, T]. routed_experts [T, MoE layers, k]: experts to route each token
        to (router replay; -1 where none was recorded), for a batch of one row. routing_mask [T] bool: the
        tokens the routing summaries count (None: all; context parallelism leaves out its padding)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(x, position_ids)
        summaries = []
        for layer in self.model.layers:
            replay = None
            if routed_experts is not None and layer.is_moe:
                replay = routed_experts[:, len(summaries)]
            x, summary = layer(x, cos, sin, self.attention, replay, routing_mask, **attention_kwargs)
            if summary is not None:
                summaries.append(summary)
        logits = self.lm_head(self.model.norm(x))
        return CausalLMOutput(logits, torch.stack(summaries) if summaries else None)

    def init_weights(self, std: float = 0.02) -> None:
        """Random weights as transformers initialises these families: normal(0, std) matrices, unit norms,
        zero biases (for benchmarks, which need no checkpoint)."""
        for name, parameter in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(parameter)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)
            else:
                nn.init.normal_(parameter, std=std)
        for name, buffer in self.named_buffers():
            if name.endswith("e_score_correction_bias"):
                nn.init.zeros_(buffer)
