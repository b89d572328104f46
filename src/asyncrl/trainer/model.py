"""The trained model: load a causal LM in float32, shard it with FSDP2, optimize it, gather it back.

The model is ours (`asyncrl.models`) where its family is registered, else transformers' class
(`model.impl`, `resolve_impl`); both hold the same parameter names and load the same folders.

Parallelism is applied to the plain model by `parallelize`, kept apart from loading (as in torchtitan):
activation checkpointing and torch.compile on each decoder layer, then FSDP2 on each decoder layer and the
root, or on the root alone (`perf.fsdp_unit`). RL, SFT and `asyncrl trainer --bench` share this one code
path for 1..N ranks (docs/trainer.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, PreTrainedModel

from asyncrl.config.schema import ModelConfig, OptimConfig, PerfConfig
from asyncrl.errors import AsyncRLError
from asyncrl.loading import check_model_name, load_model
from asyncrl.models import native_problem
from asyncrl.models.checkpoint import load_native
from asyncrl.models.context_parallel import ContextParallel, check_heads, ulysses_attention
from asyncrl.models.expert_parallel import shard_experts
from asyncrl.models.transformer import CausalLM
from asyncrl.trainer.attention import DOCUMENT_ATTENTION, document_attention, model_kernels
from asyncrl.trainer.logprobs import defer_lm_head
from asyncrl.trainer.lora import apply_lora


def resolve_impl(model_cfg: ModelConfig, perf: PerfConfig, config=None) -> str:
    """`model.impl` for this model: "native" (ours) or "hf" (transformers'). auto: ours where the family is
    registered and its config has nothing we lack, and the attention is document attention (perf.attention =
    "dense" is transformers' own mask)."""
    if model_cfg.impl == "hf":
        return "hf"
    if config is None:
        check_model_name(model_cfg.name)
        config = AutoConfig.from_pretrained(model_cfg.name)
    problem = native_problem(config)
    if perf.attention == "dense":
        problem = "perf.attention = 'dense' is transformers' block-diagonal mask"
    if problem is None:
        return "native"
    if model_cfg.impl == "native":
        raise AsyncRLError(f"model.impl = 'native' cannot take {model_cfg.name}: {problem} (set model.impl = 'hf')")
    return "hf"


def setup_model(model_cfg: ModelConfig, device: torch.device, perf: PerfConfig) -> PreTrainedModel | CausalLM:
    """Master weights are always float32; `model.dtype = "bfloat16"` only sets the compute dtype (FSDP2).
    With `model.lora` only adapters train; they are added here, before sharding,
    so they shard with the FSDP2 unit around them."""
    if resolve_impl(model_cfg, perf) == "native":
        model = load_native(model_cfg.name, device, torch.float32)
    else:
        model = load_model(model_cfg, device, dtype=torch.float32)
    return apply_lora(prepare_model(model, perf), model_cfg.lora)


def prepare_model(model: PreTrainedModel | CausalLM, perf: PerfConfig) -> PreTrainedModel | CausalLM:
    """Make a loaded model a trained one: no KV cache, the chosen attention and its kernels (for the device
    the model is on), an LM head applied in chunks."""
    # Packed rows need it (transformers keeps packed samples apart only without a cache), and training never
    # reuses a cache.
    model.config.use_cache = False
    if isinstance(model, CausalLM):
        model.attention = document_attention  # ours always keeps packed samples apart
    elif perf.attention == "document":
        model.set_attn_implementation(DOCUMENT_ATTENTION)
    if isinstance(model, CausalLM) or perf.attention == "document":
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


@dataclass(frozen=True)
class Meshes:
    """The trainer's one device mesh, cut into the meshes each parallelism works on."""

    dense: DeviceMesh  # FSDP2 of the dense parameters: all ranks
    experts: DeviceMesh | None = None  # expert parallelism: FSDP2 of the experts (the ranks holding the same ones)
    ep: DeviceMesh | None = None  # expert parallelism: the ranks that share one copy of the experts
    cp: DeviceMesh | None = None  # context parallelism: the ranks that split the same rows


def device_meshes(device_type: str, world_size: int, ep: int, cp: int = 1) -> Meshes:
    """The trainer's one device mesh, as torchtitan lays it out: world = dp x cp, and with expert parallelism
    world = dp_mod_ep x ep_mod_cp x cp, where the ep ranks (ep_mod_cp x cp) span whole context-parallel groups.
    FSDP2 shards dense parameters over all ranks (the ranks of a context-parallel group hold the same
    parameters, so they shard them too)."""
    for name, size in (("ep", ep), ("cp", cp)):
        if world_size % size:
            raise AsyncRLError(f"trainer.{name} = {size} does not divide the {world_size} trainer ranks")
    if ep > 1 and ep % cp:
        raise AsyncRLError(
            f"trainer.ep = {ep} is not a multiple of trainer.cp = {cp}: the expert-parallel ranks span whole "
            "context-parallel groups (set trainer.ep to a multiple of trainer.cp)"
        )
    if ep == 1 and cp == 1:
        return Meshes(init_device_mesh(device_type, (world_size,)))
    if ep == 1:
        mesh = init_device_mesh(device_type, (world_size // cp, cp), mesh_dim_names=("dp", "cp"))
        return Meshes(mesh["dp", "cp"]._flatten("dp_cp"), cp=mesh["cp"])
    if cp == 1:
        mesh = init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))
        return Meshes(mesh["dp_mod_ep", "ep"]._flatten("dp"), mesh["dp_mod_ep"], mesh["ep"])
    shape = (world_size // ep, ep // cp, cp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("dp_mod_ep", "ep_mod_cp", "cp"))
    dense = mesh["dp_mod_ep", "ep_mod_cp", "cp"]._flatten("dp")
    return Meshes(dense, mesh["dp_mod_ep"], mesh["ep_mod_cp", "cp"]._flatten("ep"), mesh["cp"])


def check_context_parallel(model: PreTrainedModel | CausalLM, cp: int) -> None:
    if cp == 1:
        return
    if not isinstance(model, CausalLM):
        raise AsyncRLError(
            f"trainer.cp = {cp} splits rows inside our own model implementations: set model.impl = 'native' "
            "(transformers' models cannot run it)"
        )
    check_heads(model.spec.num_heads, model.spec.num_kv_heads, cp)


def parallelize(
    model: PreTrainedModel | CausalLM,
    world_size: int,
    device: torch.device,
    dtype: str,
    perf: PerfConfig,
    ep: int = 1,
    cp: int = 1,
) -> PreTrainedModel | CausalLM:
    """Every parallelism, composed on one device mesh (`device_meshes`): context parallelism (`cp` > 1: the
    model's attention wrapped in the Ulysses exchange, `models/context_parallel.py`; the model then carries its
    `context_parallel` group, which `row_logprobs` slices rows by); then in a fixed order per decoder layer:
    expert parallelism (`ep` > 1: the layer's experts sharded over the ep ranks, their own FSDP2 unit over the
    others), activation checkpointing, torch.compile, and with `fsdp_unit` "layer" an FSDP2 shard of its own;
    then shard the root (embeddings, final norm, LM head, and with "model" the layers too). A router that
    computes in float32 (GLM's) gets an FSDP2 unit that keeps its weight in float32.

    The wrappers change parameter names (`_checkpoint_wrapped_module.`, `_orig_mod.`);
    `get_model_state_dict` strips them, so published weights and checkpoints keep the model's own names.
    Gradients are summed over ranks, not averaged: every loss is already divided by the token count of
    the global batch, so an average would shrink gradients by the number of ranks.
    """
    check_context_parallel(model, cp)
    meshes = device_meshes(device.type, world_size, ep, cp)
    mesh, expert_mesh, ep_mesh = meshes.dense, meshes.experts, meshes.ep
    if meshes.cp is not None:
        model.context_parallel = ContextParallel(meshes.cp.get_group(), meshes.cp.get_local_rank(), cp)
        model.attention = ulysses_attention(model.attention, model.context_parallel)
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
    if ep > 1 and not any(getattr(layer, "is_moe", False) for layer in layers):
        raise AsyncRLError(
            f"trainer.ep = {ep} shards routed experts: it needs a mixture-of-experts model and model.impl = 'native'"
        )
    for index, layer in enumerate(list(layers)):
        if getattr(layer, "is_moe", False):
            if ep_mesh is not None:
                shard_experts(layer.mlp.experts, ep_mesh)
                fully_shard(
                    layer.mlp.experts,
                    mesh=expert_mesh,
                    mp_policy=mp_policy,
                    offload_policy=offload_policy,
                    reshard_after_forward=reshard,
                )
            if layer.mlp.gate.keep_float32 and dtype == "bfloat16":
                fully_shard(layer.mlp.gate, mesh=mesh, mp_policy=MixedPrecisionPolicy(), offload_policy=offload_policy)
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
    """Clip to `max_norm`; returns the total norm before clipping, over the full (unsharded) gradient. A norm
    under the limit leaves the gradients untouched.

    Works on each rank's local shards (FSDP2 shards are disjoint, so squared norms add up over ranks): one
    all-reduce, instead of a DTensor dispatch per gradient, which cost ~10 ms of host time per step for a
    0.6B model on one H200, while the GPU work is ~1 ms."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    sharded = isinstance(grads[0], DTensor)
    if not sharded and isinstance(model, FSDPModule):
        raise AsyncRLError(
            "FSDP2 did not reduce the gradients (its backward hooks never ran), so the optimizer would change no "
            "weight: the model's forward must return its tensors as a tuple, a NamedTuple or a dict"
        )
    local = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
    squares = torch.stack([norm.float() for norm in torch._foreach_norm(local)]).square().sum()
    if sharded:
        if dist.get_backend() == "nccl" and squares.device.type == "cpu":  # CPU-offloaded gradients
            squares = squares.to(torch.cuda.current_device())
        dist.all_reduce(squares)
    total_norm = float(squares.sqrt())  # the caller logs it: this sync would happen anyway
    if total_norm + 1e-6 > max_norm:  # scaling every gradient by 1 read and wrote 22 GB per step of a 5.6B model
        torch._foreach_mul_(local, max_norm / (total_norm + 1e-6))
    return total_norm


def make_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW; on GPU its fused implementation (a few kernel launches for all parameters, not several per
    tensor group). CPU parameters (CPU runs, or `perf.cpu_offload`) keep torch's default. One parameter group
    per device mesh: with expert parallelism the experts' DTensors live on another mesh than the rest, and
    one multi-tensor kernel cannot mix the two."""
    on_gpu = next(model.parameters()).device.type == "cuda"
    by_mesh: dict[int, list[nn.Parameter]] = {}
    for parameter in model.parameters():
        mesh = parameter.device_mesh if isinstance(parameter, DTensor) else None
        by_mesh.setdefault(id(mesh), []).append(parameter)
    return torch.optim.AdamW(
        [{"params": group} for group in by_mesh.values()],
        lr=optim.lr,
        betas=optim.betas,
        weight_decay=optim.weight_decay,
        fused=on_gpu or None,
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
