"""GLM-4.5 (glm4_moe): attention with q/k/v biases and rotary embeddings on part of each head
(`partial_rotary_factor`); the first `first_k_dense_replace` layers dense, the others a mixture of experts with
sigmoid routing (a balancing bias on the choice, group-limited top k, renormalised, scaled by
`routed_scaling_factor`) plus shared experts. The checkpoint's multi-token-prediction layers (numbered past
`num_hidden_layers`) serve speculative decoding only: they are not loaded, nor published."""

from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding

from asyncrl.models.family import Family, StateDict, common_problem, decoder_shape
from asyncrl.models.moe import MoESpec, fuse_experts, split_experts
from asyncrl.models.transformer import DecoderSpec


def spec(config) -> DecoderSpec:
    return DecoderSpec(
        **decoder_shape(config),
        qkv_bias=config.attention_bias,
        qk_norm=config.use_qk_norm,
        moe=MoESpec(
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            router="sigmoid",
            norm_topk_prob=config.norm_topk_prob,
            routed_scaling_factor=config.routed_scaling_factor,
            num_groups=config.n_group,
            topk_groups=config.topk_group,
            shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
        ),
        moe_layers=tuple(range(config.first_k_dense_replace, config.num_hidden_layers)),
    )


def from_checkpoint(state: StateDict, config) -> StateDict:
    def kept(name: str) -> bool:
        return not (name.startswith("model.layers.") and int(name.split(".")[2]) >= config.num_hidden_layers)

    return fuse_experts({name: tensor for name, tensor in state.items() if kept(name)})


FAMILY = Family(
    "glm4_moe",
    spec,
    Glm4MoeRotaryEmbedding,
    common_problem,
    from_checkpoint=from_checkpoint,
    to_checkpoint=split_experts,
    expert_parallel=True,
)
