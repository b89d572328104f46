"""Training throughput figures: tokens/s and MFU (model FLOPs utilization).

MFU counts the FLOPs the model needs, not those the step spends: 6 x N x tokens for the matrix
multiplications (N: parameters used as matmul weights; forward 2N, backward 4N per token) plus attention,
12 x layers x query heads x head_dim per (query, key) pair inside each document's causal triangle.
Recomputation by activation checkpointing is not counted. Divided by step time and by the devices' peak
dense bf16 FLOP/s (datasheet), so figures compare with other trainers' MFU.
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
    """Parameters that multiply activations: all of them but an input embedding that is only looked up (a tied
    embedding is the LM head's weight, so it counts once)."""
    total = sum(p.numel() for p in model.parameters())
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if embedding is head else total - embedding.numel()


def training_flops(model: PreTrainedModel, document_lengths: list[int]) -> float:
    """Model FLOPs of one forward + backward over a packed row of these documents."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    tokens = sum(document_lengths)
    causal_pairs = sum(n * (n + 1) // 2 for n in document_lengths)
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * causal_pairs
    return 6 * matmul_params(model) * tokens + attention
