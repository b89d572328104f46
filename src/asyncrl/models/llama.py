"""Llama: grouped-query attention, SwiGLU MLPs (biases where the config asks), Llama 3's rotary scaling."""

from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from asyncrl.models.family import Family, common_problem, decoder_shape
from asyncrl.models.transformer import DecoderSpec


def spec(config) -> DecoderSpec:
    return DecoderSpec(
        **decoder_shape(config),
        qkv_bias=config.attention_bias,
        output_bias=config.attention_bias,
        mlp_bias=getattr(config, "mlp_bias", False),
    )


def problem(config) -> str | None:
    if (getattr(config, "pretraining_tp", 1) or 1) > 1:
        return "its config sets pretraining_tp > 1"
    return common_problem(config)


FAMILY = Family("llama", spec, LlamaRotaryEmbedding, problem)
