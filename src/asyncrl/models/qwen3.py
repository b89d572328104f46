"""Qwen3 (dense): grouped-query attention with RMS norms on each query and key head, SwiGLU MLPs."""

from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from asyncrl.models.family import Family, common_problem, decoder_shape
from asyncrl.models.transformer import DecoderSpec


def spec(config) -> DecoderSpec:
    return DecoderSpec(
        **decoder_shape(config),
        qkv_bias=config.attention_bias,
        output_bias=config.attention_bias,
        qk_norm=True,
    )


FAMILY = Family("qwen3", spec, Qwen3RotaryEmbedding, common_problem)
