"""`asyncrl model init`: a small model of a registered family (Qwen3, Llama, Qwen3-MoE, GLM-4.5) and a byte-level
tokenizer, built offline.

The mixture-of-experts architectures take the preset's shape with 8 experts, each token routed to 2, each
expert half the preset's MLP width (so a token's active MLP is as wide as the dense model's); GLM-4.5's also
has one shared expert, a dense first layer, and rotary embeddings on half of each head.

The result is an ordinary Hugging Face directory: `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load it, so every other part of asyncrl treats it like a hub model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, as Qwen models use it: every message is <|im_start|>role\ncontent<|im_end|>\n. Tools given to
# `apply_chat_template(tools=...)` are listed first, in a system message, with the calling convention Qwen
# uses: the assistant writes <tool_call>{"name": ..., "arguments": {...}}</tool_call> (an assistant message's
# `tool_calls`, in OpenAI's shape, are written so after its content); results come back as messages of role
# `tool`.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    '{{ \'</tools>\nCall a tool with <tool_call>{"name": <name>, "arguments": <json object>}</tool_call>.\' }}'
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set function = call.get('function', call) %}"
    "{% set arguments = function.get('arguments', {}) %}"
    "{{ '<tool_call>{\"name\": ' + function['name'] | tojson + ', \"arguments\": ' }}"
    "{{ arguments if arguments is string else arguments | tojson }}{{ '}</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


PRESETS = {
    "tiny": Preset(64, 2, 2, 1, 32, 192),  # ~0.1M parameters: unit tests
    "small": Preset(128, 4, 4, 2, 32, 384),  # ~1M: the CPU demo
    "medium": Preset(256, 6, 4, 2, 64, 768),  # ~5M
    "30m": Preset(512, 10, 8, 4, 64, 1536),  # ~32M: CPU benchmarks
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: 256 byte symbols plus the ChatML special tokens, so any text round-trips."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


EXPERTS, EXPERTS_PER_TOKEN = 8, 2


def moe_options(architecture: str, preset: Preset) -> dict:
    """The mixture-of-experts keys of an architecture's config (module docstring); none for dense ones."""
    expert_width = preset.intermediate_size // EXPERTS_PER_TOKEN
    if architecture == "qwen3_moe":
        return {"num_experts": EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN, "moe_intermediate_size": expert_width}
    if architecture == "glm4_moe":
        return {
            "n_routed_experts": EXPERTS,
            "num_experts_per_tok": EXPERTS_PER_TOKEN,
            "moe_intermediate_size": expert_width,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "partial_rotary_factor": 0.5,
            "num_nextn_predict_layers": 0,
        }
    return {}


ARCHITECTURES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM),
}


def build_model(
    tokenizer: PreTrainedTokenizerFast, preset: Preset, seed: int = 0, architecture: str = "qwen3"
) -> PreTrainedModel:
    config_class, model_class = ARCHITECTURES[architecture]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        head_dim=preset.head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **moe_options(architecture, preset),
    )
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return model


def init_model(output: Path, preset: str = "small", seed: int = 0, architecture: str = "qwen3") -> int:
    """Write a fresh model + tokenizer to `output`; returns the parameter count."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset '{preset}'; choose one of: {', '.join(PRESETS)}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture '{architecture}'; choose one of: {', '.join(ARCHITECTURES)}")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, PRESETS[preset], seed, architecture)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return sum(p.numel() for p in model.parameters())
