"""Configuration: pydantic models and the loader for TOML layers and CLI flags."""

from asyncrl.config.loader import ConfigError, load, to_toml, write_toml
from asyncrl.config.schema import (
    InferenceConfig,
    OrchestratorConfig,
    RLConfig,
    SFTConfig,
    TrainerConfig,
)

__all__ = [
    "ConfigError",
    "InferenceConfig",
    "OrchestratorConfig",
    "RLConfig",
    "SFTConfig",
    "TrainerConfig",
    "load",
    "to_toml",
    "write_toml",
]
