"""What a registered family is: how its Hugging Face config reads as a `DecoderSpec`, which of its features we do
not implement, and how its checkpoint layout maps to the tensors in memory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from asyncrl.models.transformer import CausalLM, DecoderSpec

StateDict = dict[str, torch.Tensor]


def unchanged(state: StateDict, config: PretrainedConfig | None = None) -> StateDict:
    return state


@dataclass(frozen=True)
class Family:
    model_type: str  # the Hugging Face config's `model_type`
    spec: Callable[[PretrainedConfig], DecoderSpec]
    rotary: type[nn.Module]  # transformers' rotary embedding class of the family: its tables, exactly
    problem: Callable[[PretrainedConfig], str | None]  # a config feature we do not implement, or None
    from_checkpoint: Callable[[StateDict, PretrainedConfig], StateDict] = unchanged  # checkpoint -> in memory
    to_checkpoint: Callable[[StateDict, PretrainedConfig], StateDict] = unchanged  # in memory -> checkpoint
    expert_parallel: bool = False  # has routed experts that `trainer.ep` can shard

    def build(self, config: PretrainedConfig, device: torch.device | str = "cpu") -> CausalLM:
        """The model with uninitialised weights on `device` (on "meta" none are allocated)."""
        with torch.device(device):
            return CausalLM(config, self.spec(config), lambda: self.rotary(config))


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def decoder_shape(config: PretrainedConfig) -> dict:
    """The `DecoderSpec` fields every family reads from the same config keys."""
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim(config),
        rms_norm_eps=config.rms_norm_eps,
        intermediate_size=config.intermediate_size,
        tie_word_embeddings=config.tie_word_embeddings,
    )


def common_problem(config: PretrainedConfig) -> str | None:
    """What none of our families implement: other activations, sliding-window attention."""
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"its MLP activation is '{config.hidden_act}', not silu"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "it uses sliding-window attention"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return "some of its layers use sliding-window attention"
    return None
