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
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="compute dtype (the trainer keeps fp32 master weights)"
    )
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="transformers attention kernel")


class SamplingConfig(Config):
    temperature: float = Field(1.0, gt=0, description="sampling temperature; logprobs are taken at it")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    max_tokens: int = Field(64, ge=1, description="most tokens sampled per turn")


class EnvironmentConfig(Config):
    name: str = Field("reverse_text", description="built-in environment name")
    args: dict = Field(default_factory=dict, description="keyword arguments of the environment")


class OptimConfig(Config):
    lr: float = Field(1e-5, gt=0, description="AdamW peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    max_grad_norm: float = Field(1.0, gt=0, description="gradients are clipped to this global norm")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0 to lr over these steps, then constant")


class LossConfig(Config):
    delta_low: float = Field(0.2, ge=0, description="trust region below: mask if mu - pi > delta_low and A < 0")
    delta_high: float = Field(0.2, ge=0, description="trust region above: mask if pi - mu > delta_high and A > 0")
    kl_tau: float = Field(1e-3, ge=0, description="weight of the squared log-ratio term")


class InferenceConfig(Config):
    model: ModelConfig = ModelConfig()
    seq_len: int = Field(2048, ge=8, description="longest prompt + completion the server accepts")
    seed: int = Field(0, description="seed of data order and sampling")
    output_dir: Path = Field(Path("outputs/run"), description="the run folder (see README: a run on disk)")
    backend: Literal["native"] = Field("native", description="the embedded engine (vLLM comes later)")
    host: str = Field("127.0.0.1", description="address to bind; loopback by default")
    port: int = Field(8000, ge=0, le=65535, description="port to bind; 0 under `asyncrl rl` picks a free one")
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    max_batch_size: int = Field(256, ge=1, description="sequences decoded together")
    num_threads: int = Field(0, ge=0, description="torch CPU threads; 0 keeps torch's default")
    admin_token: str | None = Field(
        None, description="token for /admin routes; default: the ASYNCRL_ADMIN_TOKEN environment variable"
    )


class OrchestratorConfig(Config):
    model: ModelConfig = ModelConfig()
    seq_len: int = Field(2048, ge=8, description="tokens in one packed micro-batch row")
    max_steps: int = Field(20, ge=1, description="training steps (batches)")
    seed: int = Field(0, description="seed of data order and sampling")
    output_dir: Path = Field(Path("outputs/run"), description="the run folder (see README: a run on disk)")
    inference_url: str = Field("http://127.0.0.1:8000", description="the inference server (set by `asyncrl rl`)")
    environment: EnvironmentConfig = EnvironmentConfig()
    sampling: SamplingConfig = SamplingConfig()
    batch_size: int = Field(64, ge=1, description="rollouts per training step")
    group_size: int = Field(8, ge=1, description="rollouts per example; advantages compare within a group")
    std_normalize: bool = Field(False, description="divide advantages by the group's reward std")
    max_async_level: int = Field(1, ge=0, description="batch n uses policy versions >= n - 1 - max_async_level")
    max_concurrency: int = Field(64, ge=1, description="groups in flight on the inference server")
    num_trainer_ranks: int = Field(1, ge=1, description="batch files per step (set by `asyncrl rl`)")
    samples_per_step: int = Field(
        4, ge=0, description="decoded rollouts (one per prompt) written to samples.jsonl each step"
    )
    request_timeout: float = Field(600.0, gt=0, description="seconds for one generate request")
    wait_timeout: float = Field(900.0, gt=0, description="seconds to wait for the inference server or new weights")
    admin_token: str | None = Field(None, description="default: the ASYNCRL_ADMIN_TOKEN environment variable")

    @model_validator(mode="after")
    def _groups_fill_batch(self) -> OrchestratorConfig:
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size})")
        return self


class TrainerConfig(Config):
    model: ModelConfig = ModelConfig()
    seq_len: int = Field(2048, ge=8, description="tokens in one packed row")
    max_steps: int = Field(20, ge=1, description="training steps (batches)")
    seed: int = Field(0, description="seed of data order and sampling")
    output_dir: Path = Field(Path("outputs/run"), description="the run folder (see README: a run on disk)")
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda' (each rank takes cuda:LOCAL_RANK)")
    num_threads: int = Field(0, ge=0, description="torch CPU threads per rank; 0 keeps torch's default")
    keep_rollouts: bool = Field(False, description="keep rollout files after training on them")
    keep_weights: int = Field(3, ge=1, description="newest weights/step_N folders kept on disk")
    wait_timeout: float = Field(900.0, gt=0, description="seconds to wait for the next batch")


class SFTDataConfig(Config):
    environment: EnvironmentConfig = EnvironmentConfig()
    batch_size: int = Field(64, ge=1, description="examples per optimizer step")


class SFTConfig(Config):
    model: ModelConfig = ModelConfig()
    seq_len: int = Field(2048, ge=8, description="tokens in one packed row")
    max_steps: int = Field(100, ge=1, description="optimizer steps")
    seed: int = Field(0, description="seed of data order and sampling")
    output_dir: Path = Field(Path("outputs/sft"), description="metrics.jsonl and the final model (final/)")
    optim: OptimConfig = OptimConfig(lr=2e-3, warmup_steps=10)
    data: SFTDataConfig = SFTDataConfig()
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda'")
    num_threads: int = Field(0, ge=0, description="torch CPU threads per rank; 0 keeps torch's default")
    log_interval: int = Field(10, ge=1, description="steps between metric lines")


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
    seq_len: int = Field(2048, ge=8, description="tokens in one packed row; longest prompt + completion")
    max_steps: int = Field(20, ge=1, description="training steps")
    seed: int = Field(0, description="seed of data order and sampling")
    output_dir: Path = Field(Path("outputs/run"), description="the run folder (see README: a run on disk)")
    deployment: DeploymentConfig = DeploymentConfig()
    inference: InferenceConfig = InferenceConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    trainer: TrainerConfig = TrainerConfig()


SHARED_KEYS = ("model", "seq_len", "max_steps", "seed", "output_dir")
RL_SECTIONS = ("inference", "orchestrator", "trainer")
