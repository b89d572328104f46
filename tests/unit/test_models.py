"""Our implementation of every registered family equals transformers' (logits, loss, gradients) on tiny random
configs in float32, and reads and writes the Hugging Face checkpoint layout unchanged."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Glm4MoeConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig

from asyncrl.models import FAMILIES, native_problem
from asyncrl.models.checkpoint import checkpoint_state_dict, from_transformers, load_native
from asyncrl.models.moe import balance, summary_parts

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)

CONFIGS = {
    "qwen3": lambda: Qwen3Config(**COMMON, tie_word_embeddings=True),
    "llama": lambda: LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
    # decoder_sparse_step 2: layers 1 routes, 0 and 2 are dense
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2
    ),
    # two expert groups, one chosen; half the head dims rotated; q/k/v biases; one shared expert
    "glm4_moe": lambda: Glm4MoeConfig(
        **COMMON,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        attention_bias=True,
        partial_rotary_factor=0.5,
        num_nextn_predict_layers=0,
    ),
}


def transformers_model(model_type: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[model_type](), dtype=torch.float32, attn_implementation="sdpa")
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zeros at init: give the choice something to move
            buffer.copy_(torch.rand_like(buffer) * 0.1)
    return model.eval()


def test_every_registered_family_has_a_tiny_config():
    assert set(CONFIGS) == set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_our_model_gives_transformers_logits_and_gradients(model_type):
    reference = transformers_model(model_type)
    ours = from_transformers(reference)  # the same tensors: one set of weights, two forwards
    input_ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(2))

    def loss_and_grads(forward):
        reference.zero_grad(set_to_none=True)
        logits = forward()
        loss = torch.nn.functional.cross_entropy(logits[0], targets[0])
        loss.backward()
        return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in reference.named_parameters()}

    ref_logits, ref_loss, ref_grads = loss_and_grads(lambda: reference(input_ids=input_ids, use_cache=False).logits)
    our_logits, our_loss, our_grads = loss_and_grads(lambda: ours(input_ids).logits)
    torch.testing.assert_close(our_logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(our_loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert ref_grads.keys() == our_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(our_grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe"])
def test_moe_layers_report_their_routing(model_type):
    ours = from_transformers(transformers_model(model_type))
    output = ours(torch.randint(0, 97, (1, 50)))
    layers, width = output.routing.shape
    assert layers == len(ours.moe_layers) and width == 2 + 2 * 8
    tokens, _, probs, counts = summary_parts(output.routing)
    assert torch.equal(tokens, torch.full((layers,), 50.0))
    assert torch.equal(counts.sum(dim=1), torch.full((layers,), 50.0 * 2))  # every token to 2 experts
    torch.testing.assert_close(probs.sum(dim=1), torch.full((layers,), 50.0))  # each token's probabilities sum to 1
    assert (balance(output.routing) >= 1 - 1e-6).all()  # the balancing loss is 1 at best
    assert balance(output.routing).requires_grad


def test_summaries_of_a_rows_slices_add_up_to_the_rows():
    """Context parallelism's premise: the masked summaries of two slices sum to the whole row's, and the slices'
    shares of the balancing loss (`balance` with their own probabilities) sum to the row's balancing loss."""
    ours = from_transformers(transformers_model("qwen3_moe"))
    ids = torch.randint(0, 97, (1, 50))
    whole = ours(ids).routing
    first = ours(ids, routing_mask=torch.arange(50) < 20).routing
    second = ours(ids, routing_mask=torch.arange(50) >= 20).routing
    torch.testing.assert_close(first + second, whole)
    summed = (first + second).detach()
    shares = balance(summed, summary_parts(first)[2]) + balance(summed, summary_parts(second)[2])
    torch.testing.assert_close(shares, balance(whole))


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_checkpoints_round_trip_through_transformers(model_type, tmp_path):
    """transformers writes its checkpoint layout; we read it, and what we write back loads in transformers."""
    reference = transformers_model(model_type)
    reference.save_pretrained(tmp_path / "hf")
    ours = load_native(str(tmp_path / "hf"))
    written = checkpoint_state_dict(ours.config, ours.state_dict())
    from safetensors.torch import load_file

    on_disk = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(written) - {"lm_head.weight"} == set(on_disk) - {"lm_head.weight"}  # the same names, per expert
    for name, tensor in on_disk.items():
        torch.testing.assert_close(written[name], tensor, atol=0, rtol=0, msg=name)

    input_ids = torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(
            ours(input_ids).logits, reference(input_ids=input_ids, use_cache=False).logits, atol=1e-5, rtol=1e-5
        )


def test_an_unregistered_architecture_is_named():
    from transformers import MistralConfig

    assert "'mistral' is not one of" in native_problem(MistralConfig(**COMMON))


def test_a_feature_we_lack_is_named():
    config = Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert "sliding-window" in native_problem(config)
