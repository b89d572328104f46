"""Qwen3-MoE: Qwen3's attention; softmax routing to the top k experts, renormalised over them
(`norm_topk_prob`); no shared experts. `decoder_sparse_step` and `mlp_only_layers` say which layers route."""

from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

from asyncrl.models.family import Family, common_problem, decoder_shape
from asyncrl.models.moe import MoESpec, fuse_experts, split_experts
from asyncrl.models.transformer import DecoderSpec


def moe_layers(config) -> tuple[int, ...]:
    only_mlp = set(getattr(config, "mlp_only_layers", None) or [])
    step = config.decoder_sparse_step
    return tuple(
        index
        for index in range(config.num_hidden_layers)
        if index not in only_mlp and config.num_experts > 0 and (index + 1) % step == 0
    )


def spec(config) -> DecoderSpec:
    return DecoderSpec(
        **decoder_shape(config),
        qkv_bias=config.attention_bias,
        output_bias=config.attention_bias,
        qk_norm=True,
        moe=MoESpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            router="softmax",
            norm_topk_prob=config.norm_topk_prob,
        ),
        moe_layers=moe_layers(config),
    )


FAMILY = Family(
    "qwen3_moe",
    spec,
    Qwen3MoeRotaryEmbedding,
    common_problem,
    from_checkpoint=fuse_experts,
    to_checkpoint=split_experts,
    expert_parallel=True,
)
