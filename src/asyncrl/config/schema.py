"""Typed configuration of every asyncrl process.

Every model forbids unknown keys, so a typo fails loudly instead of being ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from asyncrl.config.custom_loss import import_loss
from asyncrl.config.transfer_mode import transfer_mode


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoRAConfig(Config):
    rank: int = Field(
        8, ge=1, description="adapter rank r (B: out x r, A: r x in); LoRA is off until a model.lora key is set"
    )
    alpha: float = Field(16.0, gt=0, description="the update B @ A is scaled by alpha / rank")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="dropout on the adapter's input while training (0 keeps RL logprobs exact)"
    )
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="names of the linear layers that get an adapter",
    )
    experts: bool = Field(
        False,
        description="mixture-of-experts models: also give every routed expert adapters on its gate_proj, up_proj "
        "and down_proj (those of target_modules); off: attention, dense and shared-expert layers only",
    )


class ModelConfig(Config):
    name: str = Field("models/tiny", description="Hugging Face hub id or local directory")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="compute dtype (the trainer keeps fp32 master weights)"
    )
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="transformers attention kernel")
    impl: Literal["auto", "native", "hf"] = Field(
        "auto",
        description="the trainer's model: native = our implementation of the registered families (docs/models.md: "
        "expert parallelism, router replay); hf = transformers' class; auto = native where the model's family is "
        "registered and perf.attention = 'document', else hf",
    )
    lora: LoRAConfig | None = Field(
        None, description="train LoRA adapters only, publish only them ([model.lora] with defaults turns it on)"
    )


class SamplingConfig(Config):
    temperature: float = Field(1.0, gt=0, description="sampling temperature; logprobs are taken at it")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    max_tokens: int = Field(64, ge=1, description="most tokens sampled per turn")
    ignore_eos: bool = Field(
        False, description="keep sampling past EOS until max_tokens (for throughput benchmarks; training wants EOS)"
    )


class EnvironmentConfig(Config):
    name: str = Field("reverse_text", description="built-in environment name, or an import path 'module:Class'")
    args: dict = Field(default_factory=dict, description="keyword arguments of the environment")


class AdvantageConfig(Config):
    estimator: Literal["grpo", "dr_grpo", "rloo"] = Field(
        "grpo", description="group baseline: grpo (mean), dr_grpo (mean, never std), rloo (leave-one-out mean)"
    )
    std_normalize: bool = Field(False, description="grpo only: divide advantages by the group's reward std")
    length_penalty: float = Field(
        0.0, ge=0, description="subtract this x (completion tokens / longest in group) from each reward first"
    )

    @model_validator(mode="after")
    def _std_only_for_grpo(self) -> AdvantageConfig:
        if self.std_normalize and self.estimator != "grpo":
            raise ValueError(f"std_normalize applies to estimator 'grpo' only, not '{self.estimator}'")
        return self


class RLEnvironmentConfig(Config):
    """One environment of an RL run; its key in `orchestrator.environments` names it in metrics."""

    name: str | None = Field(None, description="built-in name or import path 'module:Class'; default: the key")
    args: dict = Field(default_factory=dict, description="keyword arguments of the environment")
    weight: float = Field(1.0, gt=0, description="share of each batch's groups, relative to the other environments")
    advantage: AdvantageConfig = AdvantageConfig()
    env_server: str | list[str] | None = Field(
        None,
        description="run respond() and rewards in env-server worker processes: 'local' (started by the "
        "orchestrator), or the URL(s) of `asyncrl env-server`; unset: in the orchestrator's process",
    )
    workers: int = Field(2, ge=1, description="env_server: worker processes of this environment (on each server)")
    call_timeout: float = Field(
        60.0, gt=0, description="env_server: seconds one respond() or scoring may take before its worker is restarted"
    )


class EnvServerConfig(Config):
    """`asyncrl env-server`: environments' respond() and reward functions in worker processes."""

    host: str = Field(
        "127.0.0.1", description="address to bind; it runs any environment it is asked to: keep it private"
    )
    port: int = Field(8100, ge=1, le=65535, description="port to bind")
    parent_pid: int | None = Field(None, description="exit when this process is gone (set for a 'local' env-server)")


class OptimConfig(Config):
    lr: float = Field(1e-5, gt=0, description="AdamW peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    max_grad_norm: float = Field(1.0, gt=0, description="gradients are clipped to this global norm")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0 to lr over these steps, then `scheduler`")
    scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after warm-up: constant lr, or linear / cosine decay to min_lr_ratio x lr at max_steps"
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="linear / cosine: the last step's lr as a fraction of lr")


class LossConfig(Config):
    type: Literal["default", "ppo_clip", "gspo", "custom"] = Field(
        "default",
        description="default: masked IS (delta_*); ppo_clip: clipped token ratio; gspo: clipped sequence ratio "
        "(clip_*); custom: `custom` (docs/loss.md)",
    )
    delta_low: float = Field(0.2, ge=0, description="trust region below: mask if mu - pi > delta_low and A < 0")
    delta_high: float = Field(0.2, ge=0, description="trust region above: mask if pi - mu > delta_high and A > 0")
    clip_low: float = Field(0.2, ge=0, le=1, description="ppo_clip / gspo: the ratio is clipped below at 1 - clip_low")
    clip_high: float = Field(0.2, ge=0, description="ppo_clip / gspo: the ratio is clipped above at 1 + clip_high")
    kl_tau: float = Field(1e-3, ge=0, description="weight of the squared log-ratio term")
    custom: str | None = Field(
        None, description="type = 'custom': 'module:function' taking (LossInputs, LossConfig), see docs/loss.md"
    )
    router_aux_coef: float = Field(
        0.0, ge=0, description="mixture-of-experts models: weight of the load-balancing loss added to the RL loss"
    )
    router_replay: bool = Field(
        False,
        description="mixture-of-experts models: route each token to the experts the inference engine routed it to "
        "(the rollouts carry them; native engine and model.impl = 'native')",
    )

    @model_validator(mode="after")
    def _custom_loss_importable(self) -> LossConfig:
        if (self.type == "custom") != (self.custom is not None):
            raise ValueError("set loss.custom = 'module:function' exactly when loss.type = 'custom'")
        if self.custom is not None:
            import_loss(self.custom)  # a bad path fails when the config loads, not at step 1
        return self


class CheckpointConfig(Config):
    interval: int = Field(0, ge=0, description="save checkpoints/step_N every this many steps; 0: never")
    keep_last: int = Field(2, ge=1, description="newest complete checkpoints kept; older ones are deleted")


class ProfileConfig(Config):
    """A torch.profiler Chrome trace of a few steps of one process (asyncrl/step_profiler.py)."""

    dir: Path | None = Field(
        None,
        description="folder for a torch.profiler Chrome trace of a few steps: trainer_rank_R.json from each trainer "
        "rank, orchestrator.json (every Python call too) from the orchestrator; unset: no profiling",
    )
    wait: int = Field(2, ge=0, description="steps first run untraced (start-up, compilation)")
    warmup: int = Field(1, ge=0, description="steps then traced and thrown away (the profiler's own start-up)")
    active: int = Field(2, ge=1, description="steps then kept in the trace")

    def check_fits(self, max_steps: int) -> None:
        steps = self.wait + self.warmup + self.active
        if self.dir is not None and steps > max_steps:
            raise ValueError(
                f"profile.wait + profile.warmup + profile.active = {steps} steps, past max_steps = {max_steps}: "
                "the run would end before its trace is whole (lower profile.wait or profile.active)"
            )


class InferenceProfileConfig(ProfileConfig):
    """A torch.profiler Chrome trace of an inference server (native backend) over a few policy versions: its
    steps are the weight updates it applies, so a trace spans whole versions of generation."""

    dir: Path | None = Field(
        None,
        description="folder for a torch.profiler Chrome trace of the server over a few policy versions: "
        "inference_P.json from the server on port P (native backend); unset: no profiling",
    )
    wait: int = Field(2, ge=0, description="weight updates first applied untraced (start-up, compilation)")
    warmup: int = Field(1, ge=0, description="weight updates then traced and thrown away (the profiler's start-up)")
    active: int = Field(
        2, ge=1, description="weight updates then kept in the trace (the server's stop writes what it holds)"
    )


class WandbConfig(Config):
    """Weights & Biases: one W&B run per asyncrl run, every process's metrics in it (docs/dashboard.md)."""

    mode: Literal["disabled", "online", "offline"] = Field(
        "disabled", description="online: stream to W&B; offline: write under output_dir/wandb for `wandb sync`"
    )
    project: str = Field("asyncrl", description="W&B project")
    entity: str | None = Field(None, description="W&B team or user; default: your W&B default entity")
    name: str | None = Field(None, description="W&B run name; default: the name of output_dir")
    init_timeout: float = Field(90.0, gt=0, description="seconds W&B may take to start before tracking is dropped")


class TensorBoardConfig(Config):
    enabled: bool = Field(False, description="write TensorBoard event files of every metric")
    dir: Path | None = Field(None, description="where the event files go; default: output_dir/tensorboard")


class ResumeConfig(Config):
    step: int | None = Field(
        None, ge=1, description="`--resume.step N`: continue from checkpoint N; `--resume` alone: the newest whole one"
    )


def _resume_flag(value):
    """A bare `--resume` flag (true) means: from the latest complete checkpoint."""
    if value is True:
        return {}
    return None if value is False else value


Resume = Annotated[ResumeConfig | None, BeforeValidator(_resume_flag)]


class EvalEnvironmentConfig(Config):
    """One environment of an eval; its key names it in results and metrics (eval/<label>/avg@n)."""

    name: str | None = Field(None, description="built-in name or import path 'module:Class'; default: the key")
    args: dict = Field(default_factory=dict, description="keyword arguments of the environment")
    num_examples: int = Field(32, ge=1, description="held-out examples evaluated (Environment.eval_examples)")
    pass_threshold: float = Field(1.0, description="a sample passes, for pass@k, when its reward >= this")


class EvalSuiteConfig(Config):
    """What an eval measures; shared by `asyncrl eval` and the online evals of `asyncrl rl` (docs/evals.md)."""

    environments: dict[str, EvalEnvironmentConfig] = Field(
        default_factory=dict, description="environments by label: [environments.<label>]"
    )
    samples_per_example: int = Field(4, ge=1, description="n: samples per example; avg@n is their mean reward")
    pass_at: list[int] | None = Field(
        None, description="the k of each pass@k, unbiased from the n samples; default: 1 and n"
    )
    max_concurrency: int = Field(32, ge=1, description="examples in flight on the inference server")

    @model_validator(mode="after")
    def _k_within_samples(self) -> EvalSuiteConfig:
        bad = [k for k in self.pass_at or () if not 1 <= k <= self.samples_per_example]
        if bad:
            raise ValueError(f"pass_at {bad}: each k must be between 1 and samples_per_example")
        if any("/" in label for label in self.environments):
            raise ValueError("environment labels name metrics (eval/<label>/avg@n) and may not contain '/'")
        return self

    @property
    def pass_ks(self) -> list[int]:
        return sorted(set(self.pass_at or (1, self.samples_per_example)))


class ServedModelConfig(Config):
    name: str = Field(
        "models/tiny", description="the served model's name, sent as `model`; the token route loads its tokenizer"
    )


class EvalServerConfig(Config):
    """The `asyncrl inference` server `asyncrl eval` starts for model.name when no inference_url is given."""

    seq_len: int = Field(2048, ge=8, description="longest prompt + completion the server accepts")
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    num_threads: int = Field(0, ge=0, description="torch CPU threads of the server; 0 = half the usable cores")
    args: list[str] = Field([], description="more `asyncrl inference` flags, e.g. ['--max-batch-size', '64']")
    startup_timeout: float = Field(300.0, gt=0, description="seconds for the server to load the model and answer")


class EvalConfig(EvalSuiteConfig):
    """The `asyncrl eval` config: environments against a served model."""

    model: ServedModelConfig = ServedModelConfig()
    inference_url: str | None = Field(
        None,
        description="asyncrl inference, vLLM or any OpenAI API; unset: start asyncrl inference for model.name "
        "([server]) and stop it after the eval",
    )
    server: EvalServerConfig = EvalServerConfig()
    api: Literal["auto", "generate", "chat"] = Field(
        "auto", description="token route /v1/generate, or /v1/chat/completions; auto: generate when the server has it"
    )
    output_dir: Path = Field(Path("outputs/eval"), description="results.jsonl and summary.json go here")
    sampling: SamplingConfig = SamplingConfig()
    request_timeout: float = Field(600.0, gt=0, description="seconds for one request")
    wait_timeout: float = Field(300.0, gt=0, description="seconds to wait for the server to answer /v1/models")

    @model_validator(mode="after")
    def _has_environments(self) -> EvalConfig:
        if not self.environments:
            raise ValueError("no environment to evaluate (add one: [environments.reverse_text])")
        return self


class OnlineEvalConfig(EvalSuiteConfig):
    """Evals during `asyncrl rl`, on held-out examples, sampled like the training rollouts (`sampling`), logged
    as eval/<label>/avg@n to metrics.jsonl."""

    environments: dict[str, EvalEnvironmentConfig] = Field(
        default_factory=dict, description="environments by label; empty: the training environments"
    )
    interval: int = Field(0, ge=0, description="evaluate at steps 1, 1 + interval, 1 + 2 x interval, ...; 0: never")


class VLLMConfig(Config):
    """How `backend = "vllm"` starts vLLM's OpenAI server (model, dtype, seq_len and seed come from [inference])."""

    python: str | None = Field(None, description="Python executable that has vllm installed; default: this one")
    args: list[str] = Field([], description="extra command-line arguments for vLLM's api_server")


class WeightTransferConfig(Config):
    mode: Literal["filesystem", "broadcast", "colocated"] = Field(
        "filesystem",
        description="how new weights reach inference: weights/step_N folders, a broadcast from trainer rank 0 "
        "(nccl on GPUs, gloo otherwise), or lent inside the GPU trainer rank 0 shares with every server "
        "(CUDA IPC; docs/weights.md)",
    )
    host: str = Field(
        "127.0.0.1", description="broadcast: address of trainer rank 0, which hosts the group; the servers join there"
    )
    port: int = Field(0, ge=0, le=65535, description="broadcast: its port; 0 under `asyncrl rl` picks a free one")
    timeout: float = Field(600.0, gt=0, description="broadcast: seconds to wait for the peers to join or to transfer")
    receivers: int = Field(1, ge=1, description="broadcast: inference servers in the group (set by `asyncrl rl`)")
    rank: int = Field(
        1, ge=1, description="broadcast: this server's place in the group, 1..receivers (set by `asyncrl rl`)"
    )


class InferenceConfig(Config):
    model: ModelConfig = ModelConfig()
    seq_len: int = Field(2048, ge=8, description="longest prompt + completion the server accepts")
    seed: int = Field(0, description="seed of data order and sampling")
    output_dir: Path = Field(Path("outputs/run"), description="the run folder (see README: a run on disk)")
    backend: Literal["native", "vllm"] = Field(
        "native", description="'native' (the embedded engine) or 'vllm' (a vLLM server run as a child process)"
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="native: 'auto' reads the model's weights; 'dummy' makes random ones from its config.json, "
        "as vLLM's --load-format dummy (benchmarks of shapes whose weights are not on disk)",
    )
    vllm: VLLMConfig = VLLMConfig()
    host: str = Field("127.0.0.1", description="address to bind; loopback by default")
    port: int = Field(
        8000,
        ge=0,
        le=65535,
        description="port to bind; 0: a free one (the default under `asyncrl rl`, where a fixed port P gives "
        "replica i port P + i)",
    )
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    startup_timeout: float = Field(
        600.0,
        gt=0,
        description="seconds for the server to load the model and answer /health (vLLM: minutes on a loaded "
        "CPU); `asyncrl rl` waits this long for it",
    )
    max_batch_size: int = Field(256, ge=1, description="sequences decoded together (KV-cache slots, at most)")
    kv_cache_gb: float | None = Field(
        None,
        gt=0,
        description="GiB preallocated for the KV cache, one seq_len slot per running sequence; default: what "
        "max_batch_size slots need, at most 2 GiB on CPU or 80% of the GPU memory left free by the model (vLLM's too)",
    )
    kv_cache_layout: Literal["slots", "paged"] = Field(
        "slots",
        description="'slots': one seq_len slot per running sequence; 'paged': blocks of kv_block_size tokens from "
        "one pool, taken as sequences grow and freed as they end (not with decode_attention = 'flash'; CUDA graphs "
        "only with the Triton kernel)",
    )
    kv_block_size: int = Field(
        16, ge=1, le=256, description="tokens per KV-cache block with kv_cache_layout = 'paged' (a power of two)"
    )
    prefix_cache: bool = Field(
        False,
        description="kv_cache_layout = 'paged': keep the full blocks of ended prompts and samples, found by their "
        "tokens, so a later request starting with the same tokens prefills only the rest (dropped at every weight "
        "update; the least recently used go first when blocks run out)",
    )
    cuda_graphs: bool = Field(True, description="replay decoding steps as CUDA graphs (GPU only)")
    compile: bool = Field(
        True,
        description="fuse each decoding step's elementwise work with torch.compile (GPU only; compiled when "
        "the server starts, for every batch size)",
    )
    decode_attention: Literal["auto", "triton", "flash", "sdpa"] = Field(
        "auto",
        description="decoding attention kernel: triton (split-KV; named, also for a float32 model on a GPU, "
        "multiplying in tf32), flash (torch's flash attention) or sdpa (masked); auto: triton, else flash, on a "
        "GPU in half precision, sdpa elsewhere",
    )
    moe_kernel: Literal["auto", "triton", "grouped_mm"] = Field(
        "auto",
        description="mixture-of-experts layers in decoding steps: triton (kernels/moe_experts.py) or grouped_mm "
        "(torch's grouped matrix products, as in training; prefills always); auto: triton on a GPU in half "
        "precision, grouped_mm elsewhere",
    )
    share_prompts: bool = Field(
        True,
        description="the samples of a request admitted together keep one copy of their prompt's keys and values, "
        "which decoding attention reads for all of them (with the triton decoding attention; the others copy it "
        "into every sample's slot)",
    )
    num_threads: int = Field(
        0, ge=0, description="torch CPU threads; 0 = the usable cores (CPU affinity, capped by a cgroup CPU quota)"
    )
    weight_transfer: WeightTransferConfig = WeightTransferConfig()
    admin_token: str | None = Field(
        None, description="token for /admin routes; default: the ASYNCRL_ADMIN_TOKEN environment variable"
    )
    api_key: str | None = Field(
        None,
        description="bearer key the OpenAI and generate routes require (like vLLM's --api-key); default: the "
        "ASYNCRL_API_KEY environment variable; none: the routes are open",
    )
    served_model_name: str | None = Field(
        None, description="the model's id in the API (`model` of requests and answers); default: model.name"
    )
    max_request_bytes: int = Field(
        2 * 2**20, ge=1024, description="largest request body in bytes (a larger one is refused with 413)"
    )
    max_n: int = Field(
        128, ge=1, description="most samples one request may ask for (n, times the prompts of /v1/completions)"
    )
    chat_processes: int = Field(
        2,
        ge=0,
        description="worker processes that decode, validate and render chat bodies over 64 KiB, away from the "
        "server's GIL (started on the first such body); 0: the server's own threads do it",
    )
    max_stop_strings: int = Field(16, ge=0, description="most stop strings one request may give")
    max_stop_string_length: int = Field(64, ge=1, description="longest stop string, in characters")
    profile: InferenceProfileConfig = InferenceProfileConfig()

    @field_validator("kv_block_size")
    @classmethod
    def _block_size_is_a_power_of_two(cls, size: int) -> int:
        if size & (size - 1):
            raise ValueError(f"kv_block_size {size} is not a power of two (use 16)")
        return size

    @model_validator(mode="after")
    def _the_prefix_cache_needs_blocks(self) -> InferenceConfig:
        if self.prefix_cache and self.kv_cache_layout != "paged":
            raise ValueError(
                "inference.prefix_cache = true keeps KV-cache blocks, which only inference.kv_cache_layout = "
                "'paged' has (set kv_cache_layout = 'paged', or prefix_cache = false)"
            )
        return self

    @model_validator(mode="after")
    def _the_profiler_traces_the_native_engine(self) -> InferenceConfig:
        if self.profile.dir is not None and self.backend != "native":
            raise ValueError(
                "inference.profile traces the native engine; a vLLM server has its own profiler "
                "(VLLM_TORCH_PROFILER_DIR): unset inference.profile.dir"
            )
        return self

    @model_validator(mode="after")
    def _the_backend_takes_the_transfer_mode(self) -> InferenceConfig:
        problem = transfer_mode(self.weight_transfer.mode).backend_problem(self.backend)
        if problem:
            raise ValueError(problem)
        return self


class OrchestratorConfig(Config):
    model: ModelConfig = ModelConfig()
    seq_len: int = Field(2048, ge=8, description="tokens in one packed micro-batch row")
    max_steps: int = Field(20, ge=1, description="training steps (batches)")
    seed: int = Field(0, description="seed of data order and sampling")
    output_dir: Path = Field(Path("outputs/run"), description="the run folder (see README: a run on disk)")
    inference_urls: list[str] = Field(
        ["http://127.0.0.1:8000"],
        min_length=1,
        description="the inference servers of the pool (`asyncrl rl` sets them); native or vLLM, on any host",
    )
    inference_api_key: str | None = Field(
        None,
        description="sent as 'Authorization: Bearer <key>' to the servers' generate route (inference.api_key); "
        "default: the ASYNCRL_API_KEY environment variable",
    )
    environments: dict[str, RLEnvironmentConfig] = Field(
        default_factory=lambda: {"reverse_text": RLEnvironmentConfig()},
        description="environments sampled by weight, by label: [orchestrator.environments.<label>]",
    )
    sampling: SamplingConfig = SamplingConfig()
    eval: OnlineEvalConfig = OnlineEvalConfig()
    batch_size: int = Field(
        64, ge=1, description="rollouts per training step: a batch is cut as soon as this many are queued"
    )
    batch_tokens: int | None = Field(
        None, ge=1, description="cut a batch at this many queued tokens instead of batch_size rollouts"
    )
    group_size: int = Field(8, ge=1, description="rollouts per example; advantages compare within a group")
    max_async_level: int = Field(1, ge=0, description="batch n uses policy versions >= n - 1 - max_async_level")
    max_inflight: int = Field(64, ge=1, description="groups in flight across all inference servers at most")
    dynamic_sampling: bool = Field(
        False,
        description="leave out groups whose rewards are all equal (no signal) and draw more until the batch is "
        "full; counted as batch/filtered_groups",
    )
    server_timeout: float = Field(
        60.0, gt=0, description="seconds a server may leave /health unanswered before it is marked down"
    )
    server_failures_before_down: int = Field(
        3,
        ge=1,
        description="requests in a row failed by a server's fault (HTTP 5xx, connection refused or broken; not a "
        "timeout) before it is marked down; their groups go again to another server",
    )
    no_server_timeout: float = Field(
        300.0, gt=0, description="seconds without any inference server up before the run stops"
    )
    max_failed_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="the run stops when more than this share of the groups that ended since the last batch failed "
        "(a request rejected, HTTP 4xx, or failed on every retry), counted over at least batch_size / group_size "
        "groups; 1 never stops",
    )
    num_trainer_ranks: int = Field(
        1, ge=1, description="batch files per step: trainer ranks / trainer.cp (set by `asyncrl rl`)"
    )
    samples_per_step: int = Field(
        4, ge=0, description="decoded rollouts (one per prompt) written to samples.jsonl each step"
    )
    request_timeout: float = Field(600.0, gt=0, description="seconds for one generate request")
    wait_timeout: float = Field(900.0, gt=0, description="seconds to wait for the inference server or new weights")
    router_replay: bool = Field(
        False,
        description="ask the servers for the experts each token went to and carry them in the rollouts (set from "
        "trainer.loss.router_replay by `asyncrl rl`)",
    )
    ckpt: CheckpointConfig = CheckpointConfig()
    resume: Resume = None
    weight_transfer: WeightTransferConfig = WeightTransferConfig()
    admin_token: str | None = Field(None, description="default: the ASYNCRL_ADMIN_TOKEN environment variable")
    profile: ProfileConfig = ProfileConfig()

    @model_validator(mode="after")
    def _profile_fits_the_run(self) -> OrchestratorConfig:
        self.profile.check_fits(self.max_steps)
        return self

    @model_validator(mode="after")
    def _groups_fill_batch(self) -> OrchestratorConfig:
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size})")
        if not self.environments:
            raise ValueError("no environment given (add one: [orchestrator.environments.reverse_text])")
        if any("/" in label for label in self.environments):
            raise ValueError("environment labels name metrics (reward/<label>/mean) and may not contain '/'")
        return self


class PerfConfig(Config):
    """Speed and memory of the trainer (docs/trainer.md); the same for RL, SFT and `asyncrl trainer --bench`."""

    attention: Literal["document", "dense"] = Field(
        "document",
        description="document: attend within each packed sample only (kernel: attention_kernel); dense: "
        "transformers' block-diagonal mask over the whole row (model.attn_implementation)",
    )
    attention_kernel: Literal["auto", "cudnn", "flash", "flex", "sdpa"] = Field(
        "auto",
        description="document attention's kernel: auto = on a GPU cuDNN for rows that are one document of 4,096+ "
        "tokens (checked at start; flash where the check fails) and varlen flash for packed rows, sdpa per sample "
        "on CPU; cudnn = cuDNN for every one-document row; flash = varlen flash for all rows; flex = flex attention "
        "with a document block mask; sdpa = scaled-dot-product attention per sample",
    )
    activation_checkpointing: Literal["off", "selective", "full"] = Field(
        "off", description="recompute decoder layers in the backward: none, every other layer, or every layer"
    )
    compile: bool = Field(
        False, description="torch.compile each decoder layer and the softmax math of the chunked LM head"
    )
    cpu_offload: bool = Field(
        False, description="keep parameters, gradients and AdamW states in CPU memory (FSDP2 CPUOffloadPolicy)"
    )
    fsdp_unit: Literal["auto", "layer", "model"] = Field(
        "auto",
        description="FSDP2 units: layer = one per decoder layer, gathered one at a time (least memory with "
        "several ranks); model = the whole model as one, one gather and one reduction per step (less host "
        "work and fewer kernel launches; holds all of a step's gathered parameters and gradients at once); "
        "auto = model with one rank and no cpu_offload, layer otherwise",
    )
    logprob_chunk_size: int = Field(
        2048, ge=1, description="positions projected through the LM head at a time (logits are never made whole)"
    )


class BenchConfig(Config):
    """`asyncrl trainer --bench`: train steps on random tokens, no orchestrator."""

    loss: Literal["rl", "sft"] = Field(
        "rl", description="rl: the configured RL loss; sft: SFT's -log p of the loss tokens"
    )
    documents: int = Field(16, ge=1, description="equal-length samples packed into each seq_len row")
    micro_batches: int = Field(1, ge=1, description="rows per rank per optimizer step")
    warmup_steps: int = Field(3, ge=0, description="steps run first and left out of the figures")
    steps: int = Field(8, ge=1, description="measured steps (the figures are their medians)")
    profile: Path | None = Field(
        None,
        description="folder for a torch.profiler trace of two more steps after the measured ones (one Chrome "
        "trace per rank, open it in Perfetto); rank 0 also prints their costliest kernels",
    )


class TrainerConfig(Config):
    model: ModelConfig = ModelConfig()
    seq_len: int = Field(2048, ge=8, description="tokens in one packed row")
    max_steps: int = Field(20, ge=1, description="training steps (batches)")
    seed: int = Field(0, description="seed of data order and sampling")
    output_dir: Path = Field(Path("outputs/run"), description="the run folder (see README: a run on disk)")
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    perf: PerfConfig = PerfConfig()
    bench: BenchConfig = BenchConfig()
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda' (each rank takes cuda:LOCAL_RANK)")
    num_threads: int = Field(
        0, ge=0, description="torch CPU threads per rank; 0 = the usable cores divided among this machine's ranks"
    )
    ep: int = Field(
        1, ge=1, description="expert parallelism: ranks that share one copy of the routed experts (divides the ranks)"
    )
    cp: int = Field(
        1,
        ge=1,
        description="context parallelism: ranks that split each row's tokens between them, exchanging them for "
        "attention heads around attention (divides the ranks and the model's KV heads; model.impl native)",
    )
    keep_rollouts: bool = Field(False, description="keep rollout files after training on them")
    keep_weights: int = Field(3, ge=1, description="newest weights/step_N folders kept on disk")
    wait_timeout: float = Field(900.0, gt=0, description="seconds to wait for the next batch")
    ckpt: CheckpointConfig = CheckpointConfig()
    resume: Resume = None
    weight_transfer: WeightTransferConfig = WeightTransferConfig()
    profile: ProfileConfig = ProfileConfig()

    @model_validator(mode="after")
    def _profile_fits_the_run(self) -> TrainerConfig:
        self.profile.check_fits(self.max_steps)
        return self

    def rollout_files(self, ranks: int) -> int:
        """Rollout files per step for `ranks` trainer ranks: one per context-parallel group (its `cp` ranks read
        the same file). The trainer refuses a `cp` that does not divide its ranks when it starts."""
        return max(1, ranks // self.cp)


class SFTDataConfig(Config):
    """What SFT trains on: chat data from files or a Hugging Face dataset (`path`), or an environment's
    reference answers (`environment`, the default). docs/data.md says which tokens train."""

    environment: EnvironmentConfig = EnvironmentConfig()
    path: str | list[str] | None = Field(
        None,
        description="JSONL or Parquet file(s), a folder (datasets' save_to_disk, or of data files), or a Hugging "
        "Face hub id; unset: the environment's examples",
    )
    split: str = Field("train", description="path: the split to read (folders with splits and hub ids)")
    subset: str | None = Field(None, description="path: the dataset's configuration name on the hub")
    messages_column: str = Field(
        "messages", description="column of chat messages (tool calls included); used when the rows have it"
    )
    prompt_column: str = Field("prompt", description="else: the prompt (a string, or a list of messages)")
    completion_column: str = Field("completion", description="else: the completion (a string, or a list of messages)")
    tools_column: str = Field("tools", description="optional column of tool JSON schemas for the chat template")
    loss_on: Literal["all_assistant", "last_assistant"] = Field(
        "all_assistant", description="which assistant turns of a conversation train: every one, or the last"
    )
    epochs: int = Field(
        1,
        ge=1,
        description="passes over finite data (files, or an environment whose examples end); "
        "SFT stops after them, or at max_steps",
    )
    shuffle: bool = Field(True, description="a new seeded order of the rows every epoch (files only)")
    batch_size: int = Field(64, ge=1, description="examples per optimizer step")

    @model_validator(mode="after")
    def _one_source(self) -> SFTDataConfig:
        if self.path is not None and "environment" in self.model_fields_set:
            raise ValueError("set data.path (files or a dataset) or data.environment, not both")
        return self


class SFTEvalConfig(Config):
    size: int = Field(
        0, ge=0, description="examples held out of training (the first of the seeded stream); 0: no evaluation"
    )
    interval: int = Field(50, ge=1, description="steps between eval/loss measurements (and at the last step)")


class SFTConfig(Config):
    model: ModelConfig = ModelConfig()
    seq_len: int = Field(2048, ge=8, description="tokens in one packed row")
    max_steps: int = Field(100, ge=1, description="optimizer steps")
    seed: int = Field(0, description="seed of data order and sampling")
    output_dir: Path = Field(Path("outputs/sft"), description="metrics.jsonl and the final model (final/)")
    optim: OptimConfig = OptimConfig(lr=2e-3, warmup_steps=10)
    data: SFTDataConfig = SFTDataConfig()
    perf: PerfConfig = PerfConfig()
    ep: int = Field(
        1, ge=1, description="expert parallelism: ranks that share one copy of the routed experts (divides the ranks)"
    )
    router_aux_coef: float = Field(
        0.0, ge=0, description="mixture-of-experts models: weight of the load-balancing loss added to the SFT loss"
    )
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda'")
    num_threads: int = Field(
        0, ge=0, description="torch CPU threads per rank; 0 = the usable cores divided among this machine's ranks"
    )
    log_interval: int = Field(10, ge=1, description="steps between metric lines")
    save_interval: int = Field(
        0, ge=0, description="also write a Hugging Face model to output_dir/weights/step_N every this many steps"
    )
    eval: SFTEvalConfig = SFTEvalConfig()
    ckpt: CheckpointConfig = CheckpointConfig()
    resume: Resume = None
    wandb: WandbConfig = WandbConfig()
    tensorboard: TensorBoardConfig = TensorBoardConfig()


class DeploymentConfig(Config):
    trainer_ranks: int = Field(1, ge=1, description="torchrun processes for the trainer")
    inference_device: str = Field(
        "auto", description="device of the inference servers ('cuda:N' puts replica i on GPU N + i)"
    )
    trainer_device: str = Field("auto", description="device of the trainer ranks ('cuda:N' puts rank r on GPU N + r)")
    inference_threads: int = Field(
        0, ge=0, description="CPU threads of all inference servers, split among the replicas; 0 = half the usable cores"
    )
    trainer_threads: int = Field(0, ge=0, description="CPU threads per trainer rank; 0 = the rest of the usable cores")
    inference_replicas: int = Field(
        1, ge=1, description="inference servers started; the orchestrator spreads groups over them"
    )


class SlurmConfig(Config):
    """What `asyncrl slurm` writes into the sbatch script besides the layout (docs/clusters.md)."""

    partition: str | None = Field(None, description="#SBATCH --partition; unset: the cluster's default")
    account: str | None = Field(None, description="#SBATCH --account")
    time: str | None = Field(None, description="#SBATCH --time, e.g. '2-00:00:00'; unset: the partition's limit")
    sbatch: list[str] = Field([], description="more #SBATCH options, one per entry, e.g. ['--qos=high', '--mem=0']")
    setup: list[str] = Field([], description="shell lines run first on the first node, e.g. ['module load cuda/12.4']")
    python: str | None = Field(
        None, description="the Python with asyncrl installed on every node; default: the one that renders the script"
    )


class K8sConfig(Config):
    """What `asyncrl k8s` writes into the manifests besides the layout (docs/clusters.md)."""

    image: str | None = Field(None, description="container image with asyncrl installed (required)")
    namespace: str | None = Field(None, description="namespace of every object; unset: kubectl's current one")
    storage: str = Field("100Gi", description="size of the shared run volume (a ReadWriteMany claim)")
    storage_class: str | None = Field(None, description="storage class of the claim; unset: the cluster's default")
    volume_path: str = Field(
        "/shared", description="where the volume is mounted and every process works: relative paths live on it"
    )
    gpu_resource: str = Field("nvidia.com/gpu", description="the extended resource name of a GPU")


class ClusterConfig(Config):
    """A run over several nodes, rendered by `asyncrl slurm` or `asyncrl k8s` (docs/clusters.md): trainer nodes
    (the first also runs the orchestrator) and inference nodes. `deployment` applies to `asyncrl rl` only, but
    for its thread counts."""

    name: str | None = Field(None, description="job name / object prefix; default: output_dir's folder name")
    trainer_nodes: int = Field(1, ge=1, description="nodes of the trainer: one torchrun agent each")
    trainer_ranks_per_node: int = Field(1, ge=1, description="trainer ranks on each trainer node (one per GPU)")
    inference_nodes: int = Field(1, ge=1, description="nodes of the inference servers")
    replicas_per_node: int = Field(
        1, ge=1, description="inference servers on each inference node (one per GPU); server i listens on port + i"
    )
    gpus_per_node: int = Field(0, ge=0, description="GPUs each node has and the job requests; 0: CPU nodes")
    rendezvous_port: int = Field(
        29500, ge=1, le=65535, description="torchrun's rendezvous port on the first trainer node"
    )
    folder_timeout: float = Field(
        300.0, gt=0, description="seconds each node waits to see the run folder's token (the shared-folder check)"
    )
    slurm: SlurmConfig = SlurmConfig()
    k8s: K8sConfig = K8sConfig()

    @model_validator(mode="after")
    def _one_gpu_each(self) -> ClusterConfig:
        if self.gpus_per_node:
            for key in ("trainer_ranks_per_node", "replicas_per_node"):
                if getattr(self, key) > self.gpus_per_node:
                    raise ValueError(
                        f"cluster.{key} = {getattr(self, key)} but a node has {self.gpus_per_node} GPUs "
                        "(cluster.gpus_per_node): each takes one GPU of its own"
                    )
        return self


class RLConfig(Config):
    """The `asyncrl rl` config: one file for all three processes.

    Top-level shared keys (model, seq_len, max_steps, seed, output_dir, ckpt, resume) are copied into each
    section by the loader; the sections hold what is specific to one process.
    """

    model: ModelConfig = ModelConfig()
    seq_len: int = Field(2048, ge=8, description="tokens in one packed row; longest prompt + completion")
    max_steps: int = Field(20, ge=1, description="training steps")
    seed: int = Field(0, description="seed of data order and sampling")
    output_dir: Path = Field(Path("outputs/run"), description="the run folder (see README: a run on disk)")
    ckpt: CheckpointConfig = CheckpointConfig()
    resume: Resume = None
    weight_transfer: WeightTransferConfig = WeightTransferConfig()
    deployment: DeploymentConfig = DeploymentConfig()
    wandb: WandbConfig = WandbConfig()
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    cluster: ClusterConfig = ClusterConfig()
    inference: InferenceConfig = InferenceConfig(port=0)  # free ports: two runs on one machine do not collide
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    trainer: TrainerConfig = TrainerConfig()

    @model_validator(mode="after")
    def _router_replay_reaches_the_orchestrator(self) -> RLConfig:
        """The trainer replays what the orchestrator asked the servers for: one setting, copied here."""
        replay = self.trainer.loss.router_replay
        if replay and self.inference.backend == "vllm":
            raise ValueError(
                "trainer.loss.router_replay needs inference.backend = 'native' (vLLM does not return the experts "
                "it routed each token to)"
            )
        if self.orchestrator.router_replay != replay:
            self.orchestrator.router_replay = replay
        return self


SHARED_KEYS = ("model", "seq_len", "max_steps", "seed", "output_dir", "ckpt", "resume", "weight_transfer")
RL_SECTIONS = ("inference", "orchestrator", "trainer")
