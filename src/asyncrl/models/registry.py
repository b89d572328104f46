"""The registered families, by Hugging Face `model_type`: what `model.impl = "auto"` takes our implementation
for, and what the native engine serves. Any other model trains through transformers' own class."""

from __future__ import annotations

from transformers import PretrainedConfig

from asyncrl.models import glm4_moe, llama, qwen3, qwen3_moe
from asyncrl.models.family import Family

FAMILIES: dict[str, Family] = {
    family.model_type: family for family in (m.FAMILY for m in (qwen3, llama, qwen3_moe, glm4_moe))
}


def family_of(config: PretrainedConfig) -> Family | None:
    return FAMILIES.get(config.model_type)


def native_problem(config: PretrainedConfig) -> str | None:
    """Why our implementation cannot take this model (None: it can): an unregistered architecture, or a feature
    of its config we do not implement."""
    family = family_of(config)
    if family is None:
        return f"its architecture '{config.model_type}' is not one of: {', '.join(FAMILIES)}"
    return family.problem(config)
