"""The model shapes the benchmarks share: presets of `asyncrl model init`, the Qwen3-0.6B shape, and the
Qwen3-30B-A3B mixture-of-experts shape."""

from __future__ import annotations

from pathlib import Path

import torch

QWEN3_0_6B = "qwen3-0.6b"

# Qwen3-0.6B's config.json (hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128, MLP 3072, vocab
# 151936, tied embeddings); the weights are random.
QWEN3_06B_CONFIG = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=65536,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)


def build_model(preset: str, folder: Path, device: str = "cpu") -> Path:
    """A random-init model folder with our byte-level tokenizer: an `asyncrl model init` preset, or the
    Qwen3-0.6B shape in bf16 (built on `device`). An existing folder is reused."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from asyncrl.models.offline import build_tokenizer, init_model

    if (folder / "config.json").exists():
        return folder
    if preset != QWEN3_0_6B:
        init_model(folder, preset, seed=0)
        return folder
    tokenizer = build_tokenizer()
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_06B_CONFIG, **ids)).to(torch.bfloat16)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# Qwen3-30B-A3B's config.json (hidden 2048, 48 layers, 32 query / 4 KV heads x 128, 128 experts of width 768,
# top 8, vocab 151936, untied embeddings); `num_hidden_layers` is cut for the trainer's benchmark.
QWEN3_30B_A3B_CONFIG = dict(
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    vocab_size=151936,
    tie_word_embeddings=False,
    max_position_embeddings=131072,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)


def moe_shape_folder(folder: Path, layers: int = 48, **changes) -> Path:
    """A folder with the Qwen3-30B-A3B shape's config.json (cut to `layers`, other keys `changes`) and our
    byte-level tokenizer, no weights: the trainer's benchmark and the engine (`inference.load_format = "dummy"`)
    make random ones."""
    from transformers import Qwen3MoeConfig

    from asyncrl.models.offline import build_tokenizer

    tokenizer = build_tokenizer()
    config = {**QWEN3_30B_A3B_CONFIG, "num_hidden_layers": layers, **changes}
    Qwen3MoeConfig(**config, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    return folder
