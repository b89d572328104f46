"""MFU's FLOP count: the documented formula, by hand, and prime-rl's published MFU from its published speed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from asyncrl.trainer.perf import PEAK_BF16_FLOPS, matmul_params, peak_flops, training_flops

# Qwen3-0.6B's shape (its config.json); the FLOP count needs no weights.
QWEN3_06B_CONFIG = dict(
    hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    intermediate_size=3072, vocab_size=151_936, tie_word_embeddings=True,
)  # fmt: skip

# Qwen3-0.6B by hand: embedding (tied: it is the LM head), 28 layers of q (1024 x 2048), k and v (1024 x 1024
# each), o (2048 x 1024), gate/up/down (3 x 1024 x 3072), q/k norms (128 each), two norms (1024 each), and
# the final norm.
QWEN3_06B_PARAMS = (
    151_936 * 1024 + 28 * (2 * 1024 * 2048 + 2 * 1024 * 1024 + 3 * 1024 * 3072 + 2 * 128 + 2 * 1024) + 1024
)
ATTENTION_PER_PAIR = 12 * 28 * 16 * 128  # layers x query heads x head_dim


@pytest.fixture(scope="module")
def qwen3_06b():
    with torch.device("meta"):  # shapes only: no memory, no time
        return AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_06B_CONFIG))


def test_matmul_parameters_count_a_tied_embedding_once(qwen3_06b):
    assert QWEN3_06B_PARAMS == 596_049_920
    assert matmul_params(qwen3_06b) == QWEN3_06B_PARAMS


def test_an_untied_input_embedding_is_looked_up_not_multiplied():
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    assert matmul_params(model) == total - 1000 * 64


@pytest.mark.parametrize(
    "documents, expected",
    [
        # one document of 65,536 tokens: 6N per token + 12 x 28 x 16 x 128 per pair of its causal triangle
        ([65_536], 6 * QWEN3_06B_PARAMS * 65_536 + ATTENTION_PER_PAIR * (65_536 * 65_537 // 2)),
        ([16_384], 6 * QWEN3_06B_PARAMS * 16_384 + ATTENTION_PER_PAIR * (16_384 * 16_385 // 2)),
        # 16 documents of 1,024 tokens: the same matrix FLOPs, 1/16 of the attention pairs
        ([1_024] * 16, 6 * QWEN3_06B_PARAMS * 16_384 + ATTENTION_PER_PAIR * 16 * (1_024 * 1_025 // 2)),
        ([3, 5], 6 * QWEN3_06B_PARAMS * 8 + ATTENTION_PER_PAIR * (6 + 15)),
    ],
)
def test_training_flops_follow_the_documented_formula(qwen3_06b, documents, expected):
    assert training_flops(qwen3_06b, documents) == expected


# prime-rl's published Qwen3-0.6B rows (benchmarks/baselines of their repository: one H100, one document per
# row, full recompute): tokens/s and MFU (%), mean over their steps.
PRIME_RL_ROWS = {
    "rl-65536": (65_536, 10_147.47, 26.8046),
    "rl-16384": (16_384, 11_895.99, 11.0817),
    "sft-8192": (8_192, 26_005.17, 16.8139),
}


@pytest.mark.parametrize("name", PRIME_RL_ROWS)
def test_our_mfu_of_prime_rls_published_speed_is_their_published_mfu(qwen3_06b, name):
    seq_len, tokens_per_s, their_mfu = PRIME_RL_ROWS[name]
    flops_per_token = training_flops(qwen3_06b, [seq_len]) / seq_len
    ours = 100 * flops_per_token * tokens_per_s / PEAK_BF16_FLOPS["H100"]
    assert ours == pytest.approx(their_mfu, rel=2e-3)


def test_mfu_needs_a_known_peak():
    assert peak_flops(torch.device("cpu")) is None
    assert PEAK_BF16_FLOPS["H200"] == PEAK_BF16_FLOPS["H100"] == 989e12  # same bf16 tensor cores
