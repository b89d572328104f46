"""Typed configuration of every asyncrl process.

Every model forbids unknown keys, so a typo fails loudly instead of being ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Config):
    name: str = Field("models/tiny", description="Hugging Face hub id or local directory")
    dtype: Literal["float32", "bfloat16"] = "float32"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"


class SamplingConfig(Config):
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(64, ge=1)


class EnvironmentConfig(Config):
    name: str = "reverse_text"
    args: dict = Field(default_factory=dict, description="keyword arguments of the environment")


class OptimConfig(Config):
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)


class LossConfig(Config):
    delta_low: float = Field(0.2, ge=0, description="trust region below: mask if mu - pi > delta_low and A < 0")
    delta_high: float = Field(0.2, ge=0, description="trust region above: mask if pi - mu > delta_high and A > 0")
    kl_tau: float = Field(1e-3, ge=0, description="weight of the squared log-ratio term")


class InferenceConfig(Config):
    model: ModelConfig = ModelConfig()
    seq_len: int = Field(2048, ge=8, description="longest prompt + completion the server accepts")
    seed: int = 0
    output_dir: Path = Path("outputs/run")
    backend: Literal["native"] = "native"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    max_batch_size: int = Field(256, ge=1, description="sequences decoded together")
    num_threads: int = Field(0, ge=0, description="torch CPU threads; 0 keeps torch's default")
    admin_token: str | None = Field(
        None, description="token for /admin routes; default: the ASYNCRL_ADMIN_TOKEN environment variable"
    )


class OrchestratorConfig(Config):
    model: ModelConfig = ModelConfig()
    seq_len: int = Field(2048, ge=8, description="tokens in one packed micro-batch row")
    max_steps: int = Field(20, ge=1)
    seed: int = 0
    output_dir: Path = Path("outputs/run")
    inference_url: str = "http://127.0.0.1:8000"
    environment: EnvironmentConfig = EnvironmentConfig()
    sampling: SamplingConfig = SamplingConfig()
    batch_size: int = Field(64, ge=1, description="rollouts per training step")
    group_size: int = Field(8, ge=1, description="rollouts per example; advantages compare within a group")
    std_normalize: bool = Field(False, description="divide advantages by the group's reward std")
    max_async_level: int = Field(1, ge=0, description="batch n uses policy versions >= n - 1 - max_async_level")
    max_concurrency: int = Field(64, ge=1, description="groups in flight on the inference server")
    num_trainer_ranks: int = Field(1, ge=1)
    samples_per_step: int = Field(4, ge=0, description="decoded rollouts written to samples.jsonl each step")
    request_timeout: float = Field(600.0, gt=0, description="seconds for one generate request")
    wait_timeout: float = Field(900.0, gt=0, description="seconds to wait for the inference server or new weights")
    admin_token: str | None = Field(None, description="default: the ASYNCRL_ADMIN_TOKEN environment variable")

    @model_validator(mode="after")
    def _groups_fill_batch(self) -> OrchestratorConfig:
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size})"
            )
        return self


class TrainerConfig(Config):
    model: ModelConfig = ModelConfig()
    seq_len: int = Field(2048, ge=8)
    max_steps: int = Field(20, ge=1)
    seed: int = 0
    output_dir: Path = Path("outputs/run")
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda' (each rank takes cuda:LOCAL_RANK)")
    num_threads: int = Field(0, ge=0, description="torch CPU threads per rank; 0 keeps torch's default")
    keep_rollouts: bool = Field(False, description="keep rollout files after training on them")
    keep_weights: int = Field(3, ge=1, description="newest weights/step_N folders kept on disk")
    wait_timeout: float = Field(900.0, gt=0, description="seconds to wait for the next batch")


class SFTDataConfig(Config):
    environment: EnvironmentConfig = EnvironmentConfig()
    num_examples: int = Field(10000, ge=1)
    batch_size: int = Field(64, ge=1, description="examples per optimizer step")


class SFTConfig(Config):
    model: ModelConfig = ModelConfig()
    seq_len: int = Field(2048, ge=8)
    max_steps: int = Field(100, ge=1)
    seed: int = 0
    output_dir: Path = Path("outputs/sft")
    optim: OptimConfig = OptimConfig(lr=2e-3, warmup_steps=10)
    data: SFTDataConfig = SFTDataConfig()
    device: str = "auto"
    num_threads: int = Field(0, ge=0)
    log_interval: int = Field(10, ge=1)


class DeploymentConfig(Config):
    trainer_ranks: int = Field(1, ge=1, description="torchrun processes for the trainer")
    inference_device: str = Field("auto", description="device of the inference server")
    trainer_device: str = Field("auto", description="device of the trainer ranks")
    inference_threads: int = Field(0, ge=0, description="CPU threads of the inference server; 0 = half the cores")
    trainer_threads: int = Field(0, ge=0, description="CPU threads per trainer rank; 0 = the rest")
    startup_timeout: float = Field(300.0, gt=0, description="seconds to wait for the inference server")


class RLConfig(Config):
    """The `asyncrl rl` config: one file for all three processes.

    Top-level shared keys (model, seq_len, max_steps, seed, output_dir) are copied into each section by the
    loader; the sections hold what is specific to one process.
    """

    model: ModelConfig = ModelConfig()
    seq_len: int = 2048
    max_steps: int = 20
    seed: int = 0
    output_dir: Path = Path("outputs/run")
    deployment: DeploymentConfig = DeploymentConfig()
    inference: InferenceConfig = InferenceConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    trainer: TrainerConfig = TrainerConfig()


SHARED_KEYS = ("model", "seq_len", "max_steps", "seed", "output_dir")
RL_SECTIONS = ("inference", "orchestrator", "trainer")
