"""The trained model: load a Hugging Face causal LM in float32, shard it with FSDP2, optimize it, gather it back.

Parallelism is applied to the plain model by `parallelize`, kept apart from loading (as in torchtitan):
activation checkpointing and torch.compile on each decoder layer, then FSDP2 on each decoder layer and the
root, or on the root alone (`perf.fsdp_unit`). RL, SFT and `asyncrl trainer --bench` share this one code
path for 1..N ranks (docs/trainer.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from asyncrl.config.schema import ModelConfig, OptimConfig, PerfConfig
from asyncrl.errors import AsyncRLError
from asyncrl.loading import load_model
from asyncrl.trainer.attention import DOCUMENT_ATTENTION, model_kernels
from asyncrl.trainer.logprobs import defer_lm_head
from asyncrl.trainer.lora import apply_lora


def setup_model(model_cfg: ModelConfig, device: torch.device, perf: PerfConfig) -> PreTrainedModel:
    """Master weights are always float32; `model.dtype = "bfloat16"` only sets the compute dtype (FSDP2).
    With `model.lora` only adapters train; they are added here, before sharding,
    so they shard with the FSDP2 unit around them."""
    return apply_lora(prepare_model(load_model(model_cfg, device, dtype=torch.float32), perf), model_cfg.lora)


def prepare_model(model: PreTrainedModel, perf: PerfConfig) -> PreTrainedModel:
    """Make a loaded model a trained one: no KV cache, the chosen attention and its kernels (for the device
    the model is on), an LM head applied in chunks."""
    # Packed rows need it (transformers keeps packed samples apart only without a cache), and training never
    # reuses a cache.
    model.config.use_cache = False
    if perf.attention == "document":
        model.set_attn_implementation(DOCUMENT_ATTENTION)
        model.attention_kernels = model_kernels(model, perf.attention_kernel)  # read by `attention_kwargs`
    defer_lm_head(model)
    model.train()
    return model


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise AsyncRLError(
            f"{type(model).__name__} has no decoder `layers` list to shard (use a Llama/Qwen-style causal LM)"
        )
    return layers


def is_checkpointed(layer_index: int, activation_checkpointing: str) -> bool:
    """selective: every other layer (the odd ones), halving saved activations for a sixth more compute."""
    return activation_checkpointing == "full" or (activation_checkpointing == "selective" and layer_index % 2 == 1)


def fsdp_unit(world_size: int, perf: PerfConfig) -> str:
    """`perf.fsdp_unit` with "auto" resolved. One rank's shard is the whole parameter and its gathered
    parameters stay from the forward to the backward either way, so units per layer cost it host work per
    layer (all-gather copy-in, parameter and gradient casts, reduce-scatter) and save memory only at the end
    of the backward, where one unit holds all unreduced gradients and copies them into one float32 buffer
    for the reduction. With CPU offload, units per layer send each layer's gradients to the CPU as soon as
    its backward ends."""
    if perf.fsdp_unit != "auto":
        return perf.fsdp_unit
    return "model" if world_size == 1 and not perf.cpu_offload else "layer"


def parallelize(
    model: PreTrainedModel, world_size: int, device: torch.device, dtype: str, perf: PerfConfig
) -> PreTrainedModel:
    """Per decoder layer: activation checkpointing, torch.compile, and with `fsdp_unit` "layer" an FSDP2
    shard of its own; then shard the root (embeddings, final norm, LM head, and with "model" the layers too).

    The wrappers change parameter names (`_checkpoint_wrapped_module.`, `_orig_mod.`);
    `get_model_state_dict` strips them, so published weights and checkpoints keep the model's own names.
    Gradients are summed over ranks, not averaged: every loss is already divided by the token count of
    the global batch, so an average would shrink gradients by the number of ranks.
    """
    mesh = init_device_mesh(device.type, (world_size,))
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if dtype == "bfloat16"
        else MixedPrecisionPolicy()
    )
    # The AdamW step then runs on the CPU, on the CPU copies of the shards.
    offload_policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if perf.cpu_offload else OffloadPolicy()
    # One rank: its shard is the whole parameter, so keeping the gathered (bf16) copy from the forward for the
    # backward costs little memory and saves gathering it again.
    reshard = world_size > 1
    per_layer = fsdp_unit(world_size, perf) == "layer"
    layers = decoder_layers(model)
    for index, layer in enumerate(list(layers)):
        if is_checkpointed(index, perf.activation_checkpointing):
            layer = checkpoint_wrapper(layer)
        if perf.compile:
            layer = torch.compile(layer)
        if per_layer:
            fully_shard(
                layer, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy, reshard_after_forward=reshard
            )
        layers[index] = layer
    # The root keeps its parameters gathered after the forward (FSDP2's default for the root): the chunked
    # LM head uses its weight after the forward (`compute_logprobs`).
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # A plain SUM reduction (gloo has no pre-multiplied sum) divided by 1.
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
    return model


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip to `max_norm`; returns the total norm before clipping, over the full (unsharded) gradient.

    Works on each rank's local shards (FSDP2 shards are disjoint, so squared norms add up over ranks): one
    all-reduce, instead of a DTensor dispatch per gradient, which cost ~10 ms of host time per step for a
    0.6B model on one H200, while the GPU work is ~1 ms."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    sharded = isinstance(grads[0], DTensor)
    local = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
    squares = torch.stack([norm.float() for norm in torch._foreach_norm(local)]).square().sum()
    if sharded:
        if dist.get_backend() == "nccl" and squares.device.type == "cpu":  # CPU-offloaded gradients
            squares = squares.to(torch.cuda.current_device())
        dist.all_reduce(squares)
    total_norm = squares.sqrt()
    coefficient = (max_norm / (total_norm + 1e-6)).clamp(max=1.0).to(local[0].device)
    torch._foreach_mul_(local, coefficient)
    return float(total_norm)


def make_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW; on GPU its fused implementation (a few kernel launches for all parameters, not several per
    tensor group). CPU parameters (CPU runs, or `perf.cpu_offload`) keep torch's default."""
    on_gpu = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, fused=on_gpu or None
    )


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def apart_from(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` with each tensor that shares memory with `model` copied. On one CPU rank torch's full state
    dict holds the parameters themselves, which the next optimizer step changes in place."""

    def storage(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.untyped_storage().data_ptr()

    model_storage = {storage(tensor) for tensor in [*model.parameters(), *model.buffers()]}
    return {k: v.clone() if storage(v) in model_storage else v for k, v in state_dict.items()}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the full state dict on CPU on rank 0 (other ranks get an empty dict). A collective: every
    rank must call it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
