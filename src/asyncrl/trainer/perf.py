"""Training throughput figures: tokens/s and MFU (model FLOPs utilization).

MFU counts the FLOPs the model needs, not those the step spends:

    FLOPs of a row = 6 x N x tokens + 12 x layers x query heads x head_dim x sum over its documents of n(n+1)/2

N is the parameters that multiply a token's activations (all of them but an input embedding that is only
looked up; a tied embedding is the LM head's weight and counts once; of routed experts, the top k of E a token
goes through): 2N per token forward, 4N backward. Attention takes
two matrix products of 2 x head_dim FLOPs per (query, key) pair and query head forward and twice that
backward, 12 x head_dim in all, over the pairs inside each document's causal triangle. Recomputation
(activation checkpointing, attention kernels' own) is not counted. MFU = FLOPs of a step / step time /
(devices x peak dense bf16 FLOP/s of the datasheet).

prime-rl's trainer counts 6 x (its matmul weights) per token plus 12 x layers x heads x (hidden / heads) x
document length per token (the whole square, "no sparsity in causal attention"). For Qwen3-0.6B, whose
head_dim (128) is twice hidden / heads (64), the two agree within 0.02%, so our MFU on its published rows is
its published MFU (tests/unit/test_perf.py); for a model with head_dim = hidden / heads theirs counts twice
our attention FLOPs.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

# Dense bf16 tensor-core peak per device, from the vendors' datasheets (SXM parts).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    """The device's peak dense bf16 FLOP/s, or None where unknown (CPUs, other GPUs): MFU is then not shown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def matmul_params(model: PreTrainedModel) -> int:
    """Parameters that multiply each token's activations: all of them but an input embedding that is only looked
    up (a tied embedding is the LM head's weight, so it counts once), and of a mixture of experts' routed experts
    only the share a token goes through (top k of E: `num_experts_per_tok` / the experts' count)."""
    total = sum(p.numel() for p in model.parameters())
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    active = total if embedding is head else total - embedding.numel()
    top_k = getattr(model.config, "num_experts_per_tok", None)
    for module in model.modules():
        experts = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if top_k and all(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in experts):
            routed = sum(p.numel() for p in experts)
            active -= routed - routed * top_k // experts[0].shape[0]
    return active


def training_flops(model: PreTrainedModel, document_lengths: list[int]) -> float:
    """Model FLOPs of one forward + backward over a packed row of these documents."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    tokens = sum(document_lengths)
    causal_pairs = sum(n * (n + 1) // 2 for n in document_lengths)
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * causal_pairs
    return 6 * matmul_params(model) * tokens + attention
