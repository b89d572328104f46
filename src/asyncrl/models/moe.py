"""Mixture-of-experts layers: routers as each family defines them, experts as grouped matrix products.

Three small pieces, as torchtitan keeps them apart:

- a **router** scores every expert for every token and picks the top k: `SoftmaxRouter` (softmax over the
  experts, top k, optionally renormalised: Qwen3-MoE) and `SigmoidRouter` (sigmoid scores plus a balancing
  bias for the choice, group-limited top k, renormalised and scaled: GLM-4.5). Either can replay a recorded
  choice (`replay`: the experts the inference engine routed each token to) and then only weighs those experts;
- **experts** (`Experts`): every expert's SwiGLU weights in two 3-D tensors, gate_up_proj [E, 2I, H] and
  down_proj [E, H, I] (transformers' in-memory layout). The token-expert pairs are sorted by expert and run
  as grouped matrix products (`F.grouped_mm`, one kernel for all experts, no loop over them); dropless: every
  pair is computed, however unbalanced. With expert parallelism (`expert_parallel.py`) each rank holds E/ep
  experts and the pairs travel to their expert's rank and back by all-to-all;
- the **block** (`MoE`): router → experts → plus the shared experts where the family has them.

Each block also returns its routing summary (`summarize`): sums over its tokens of the router's entropy and
of its probability of each expert, and the token-expert pairs of each expert. They are sums so that the
slices of a row (context parallelism) add up to the row's; from them `balance` gives the load-balancing loss
of Switch Transformer, E · Σ_e f_e · P_e (f_e: the share of the token-expert pairs routed to e, P_e: e's mean
router probability; 1 when perfectly balanced), for the trainer's loss (`loss.router_aux_coef`) and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from asyncrl.models.layers import MLP


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    router: Literal["softmax", "sigmoid"]
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0  # sigmoid: the chosen experts' weights are multiplied by it
    num_groups: int = 1  # sigmoid: experts fall into groups; only the best topk_groups groups are chosen from
    topk_groups: int = 1
    shared_intermediate_size: int = 0  # shared experts (one SwiGLU MLP every token goes through); 0: none


@dataclass
class Routing:
    """The router's decision for N tokens: `indices` [N, k] of the experts, `weights` [N, k] their weights in the
    output, `probs` [N, E] float32 the distribution the balancing loss and the entropy read."""

    indices: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor


def replayed(chosen: torch.Tensor, replay: torch.Tensor | None) -> torch.Tensor:
    """The experts to use: the recorded ones where a row of `replay` [N, k] has them (-1: none recorded)."""
    if replay is None:
        return chosen
    replay = replay.to(device=chosen.device, dtype=chosen.dtype)
    return torch.where((replay >= 0).all(dim=-1, keepdim=True), replay, chosen)


class SoftmaxRouter(nn.Module):
    """softmax(x Wᵀ) over the experts in float32, the top k of it, renormalised over those k if asked."""

    keep_float32 = False

    def __init__(self, hidden_size: int, spec: MoESpec):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = spec.num_experts, spec.top_k, spec.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(spec.num_experts, hidden_size))

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> Routing:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        indices = replayed(probs.topk(self.top_k, dim=-1).indices, replay)
        weights = probs.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(indices, weights.to(logits.dtype), probs)


class SigmoidRouter(nn.Module):
    """sigmoid(x Wᵀ) in float32; the experts are chosen by score + `e_score_correction_bias` (a balancing bias
    that moves the choice, not the weights), from the `topk_groups` best groups (a group's worth: the sum of
    its two best scores); their weights are their scores, renormalised if asked, times
    `routed_scaling_factor`. Its weight and bias stay float32 in every copy of the model (`keep_float32`)."""

    keep_float32 = True

    def __init__(self, hidden_size: int, spec: MoESpec):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = spec.num_experts, spec.top_k, spec.norm_topk_prob
        self.scaling, self.num_groups, self.topk_groups = spec.routed_scaling_factor, spec.num_groups, spec.topk_groups
        self.weight = nn.Parameter(torch.zeros(spec.num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(spec.num_experts))

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> Routing:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.num_groups > 1:
            grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)
            best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.topk_groups, dim=-1).indices
            allowed = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~allowed[..., None], float("-inf")).view_as(choice)
        indices = replayed(choice.topk(self.top_k, dim=-1, sorted=False).indices, replay)
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(indices, weights * self.scaling, scores / scores.sum(dim=-1, keepdim=True))


ROUTERS = {"softmax": SoftmaxRouter, "sigmoid": SigmoidRouter}


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: with expert parallelism the experts' weights are DTensors sharded over
    the experts dimension, and each rank multiplies by its own experts."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Token-expert pairs per expert, [E] int64, without a host sync (so a CUDA graph can hold it)."""
    flat = indices.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Row group g of x times weight[g]. bfloat16 goes straight to torch's kernel, compiled graphs included;
    other dtypes (float32 on CPUs) run it eagerly: torch.compile's tracing takes bfloat16 only."""
    if x.dtype == torch.bfloat16:
        return F.grouped_mm(x, weight, offs=offsets)
    return _eager_grouped_mm(x, weight, offsets)


@torch.compiler.disable
def _eager_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return F.grouped_mm(x, weight, offs=offsets)


def grouped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    lora_scale: float = 1.0,
) -> torch.Tensor:
    """Rows of `x` sorted by expert, counts[e] of them for expert e: each through its expert's SwiGLU, all experts
    in two grouped matrix products. gate_up [E, 2I, H], down [E, H, I] (transformers' layout, out x in). With
    `lora` ({projection: (A [E, r, in], B [E, out, r])}), each adapted projection adds scale x B (A x)."""
    offsets = counts.cumsum(0).to(torch.int32)

    def low_rank(rows: torch.Tensor, name: str) -> torch.Tensor | None:
        if not lora or name not in lora:
            return None
        a, b = lora[name]
        return lora_scale * grouped_mm(grouped_mm(rows, a.transpose(-2, -1), offsets), b.transpose(-2, -1), offsets)

    gate, up = grouped_mm(x, gate_up.transpose(-2, -1), offsets).chunk(2, dim=-1)
    gate_delta, up_delta = low_rank(x, "gate_proj"), low_rank(x, "up_proj")
    gate = gate if gate_delta is None else gate + gate_delta
    up = up if up_delta is None else up + up_delta
    hidden = F.silu(gate) * up
    out = grouped_mm(hidden, down.transpose(-2, -1), offsets)
    down_delta = low_rank(hidden, "down_proj")
    return out if down_delta is None else out + down_delta


class Experts(nn.Module):
    """E SwiGLU experts as two 3-D parameters; `forward` runs every token-expert pair, dropless. With expert
    parallelism (`expert_parallel.shard_experts`) `dispatch` sends the pairs to the ranks holding their
    experts; without, it is None and every expert is here."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.dispatch = None  # an expert_parallel.TokenDispatch once sharded
        self.lora_projections: tuple[str, ...] = ()  # adapted projections (`add_lora`)
        self.lora_scale = 1.0

    def add_lora(self, rank: int, alpha: float, projections: tuple[str, ...]) -> None:
        """LoRA adapters on every expert's `projections` (of gate_proj, up_proj, down_proj), as peft makes them:
        A [E, r, in] from Kaiming's uniform, B [E, out, r] zero (so the model starts unchanged), the update
        scaled by alpha / rank. Named `lora_<projection>_A` / `_B` (trainer/lora.py publishes them per expert)."""
        hidden, width = self.down_proj.shape[1], self.down_proj.shape[2]
        shapes = {"gate_proj": (hidden, width), "up_proj": (hidden, width), "down_proj": (width, hidden)}
        device = self.down_proj.device
        for name in projections:
            fan_in, fan_out = shapes[name]
            a = torch.empty(self.num_experts, rank, fan_in, device=device)
            for expert in a:
                nn.init.kaiming_uniform_(expert, a=5**0.5)
            setattr(self, f"lora_{name}_A", nn.Parameter(a))
            setattr(self, f"lora_{name}_B", nn.Parameter(torch.zeros(self.num_experts, fan_out, rank, device=device)))
        self.lora_projections, self.lora_scale = tuple(projections), alpha / rank

    def lora_weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {
            name: (local(getattr(self, f"lora_{name}_A")), local(getattr(self, f"lora_{name}_B")))
            for name in self.lora_projections
        }

    def forward(self, x: torch.Tensor, routing: Routing, counts: torch.Tensor) -> torch.Tensor:
        """x [N, H]; routing of the N tokens; counts [E] its pairs per expert. Returns [N, H]: each token's
        experts' outputs times the router's weights, summed. The sum is a reduction over each token's k
        outputs, not atomic additions: the same inputs give the same bits, whatever else is in the batch."""
        num_tokens, top_k = routing.indices.shape
        order = routing.indices.flatten().argsort(stable=True)  # pairs grouped by expert, in token order
        rows = x[order // top_k]
        gate_up, down, lora = local(self.gate_up_proj), local(self.down_proj), self.lora_weights()

        def swiglu(pairs: torch.Tensor, pair_counts: torch.Tensor) -> torch.Tensor:
            return grouped_swiglu(pairs, pair_counts, gate_up, down, lora, self.lora_scale)

        y = swiglu(rows, counts) if self.dispatch is None else self.dispatch(rows, counts, swiglu)
        unsorted = torch.empty_like(order)
        unsorted[order] = torch.arange(order.numel(), device=order.device)
        y = y[unsorted].view(num_tokens, top_k, -1)  # back to (token, its j-th expert)
        return (y * routing.weights[..., None]).to(x.dtype).sum(dim=1)


def summarize(routing: Routing, counts: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[2 + 2E] float32 sums over the tokens (those of `mask` [N] bool where given: the others pad a context-
    parallel slice): the token count, the router's entropy, its probability of each expert (differentiable:
    the balancing loss's gradient flows through them) and the token-expert pairs of each expert."""
    probs = routing.probs
    num_experts = probs.shape[-1]
    if mask is not None:
        probs = probs * mask[:, None]
        pairs = routing.indices.flatten()
        weights = mask[:, None].expand_as(routing.indices).flatten().to(torch.int64)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=pairs.device).scatter_add_(0, pairs, weights)
    tokens = probs.new_full((1,), probs.shape[0]) if mask is None else mask.sum(dtype=torch.float32)[None]
    with torch.no_grad():
        entropy = -(probs * probs.clamp_min(1e-20).log()).sum()
    return torch.cat([tokens, entropy[None], probs.sum(dim=0), counts.float()])


def summary_parts(summary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summaries [..., 2 + 2E] as their token counts, entropy sums, probability sums [..., E], pair counts."""
    num_experts = (summary.shape[-1] - 2) // 2
    return summary[..., 0], summary[..., 1], summary[..., 2 : 2 + num_experts], summary[..., 2 + num_experts :]


def balance(summary: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """The balancing loss E · Σ_e f_e · P_e of each summary [..., 2 + 2E]; with `probs` [..., E], some tokens'
    probability sums in place of all of them: a slice's share of its row's loss (the slices' shares add up to
    it, and each one's gradient flows through its own tokens)."""
    tokens, _, own_probs, counts = summary_parts(summary)
    probs = own_probs if probs is None else probs
    share = counts / counts.sum(dim=-1, keepdim=True).clamp_min(1)  # f_e, summing to 1
    return probs.shape[-1] * (share * probs).sum(dim=-1) / tokens.clamp_min(1)


class MoE(nn.Module):
    """Router → experts (→ + shared experts). Returns the output and the routing summary (`summarize`)."""

    def __init__(self, hidden_size: int, spec: MoESpec):
        super().__init__()
        self.gate = ROUTERS[spec.router](hidden_size, spec)
        self.experts = Experts(spec.num_experts, hidden_size, spec.intermediate_size)
        if spec.shared_intermediate_size:
            self.shared_experts = MLP(hidden_size, spec.shared_intermediate_size)

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [batch, T, H]; replay [batch x T, k] recorded experts (-1: none) or None; mask [batch x T] bool: the
        tokens the summary counts (None: all)."""
        flat = x.reshape(-1, x.shape[-1])
        routing = self.gate(flat, replay)
        counts = expert_counts(routing.indices, self.experts.num_experts)
        out = self.experts(flat, routing, counts)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(flat)
        return out.view_as(x), summarize(routing, counts, mask)


def fuse_experts(state: dict[str, torch.Tensor], config=None) -> dict[str, torch.Tensor]:
    """The Hugging Face checkpoint's experts (`...mlp.experts.<e>.{gate,up,down}_proj.weight`, one matrix each)
    as the 3-D tensors in memory (`...mlp.experts.gate_up_proj` [E, 2I, H], `...mlp.experts.down_proj`
    [E, H, I]); other tensors pass unchanged. Inverse of `split_experts`."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in state.items():
        head, sep, tail = name.partition(".mlp.experts.")
        index, _, projection = tail.partition(".")
        if sep and index.isdigit() and projection in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            experts.setdefault(head, {}).setdefault(int(index), {})[projection.split(".")[0]] = tensor
        else:
            out[name] = tensor
    for head, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))) or any(len(e) != 3 for e in by_index.values()):
            raise ValueError(f"{head}.mlp.experts: experts or projections missing (each needs gate, up and down)")
        ordered = [by_index[i] for i in range(len(by_index))]
        prefix = f"{head}.mlp.experts"
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([e["gate_proj"], e["up_proj"]]) for e in ordered])
        out[f"{prefix}.down_proj"] = torch.stack([e["down_proj"] for e in ordered])
    return out


def split_expert_adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The experts' LoRA adapters (`...mlp.experts.lora_<projection>_A` [E, r, in] / `_B` [E, out, r]) in peft's
    layout for the checkpoint's one module per expert (`...mlp.experts.<e>.<projection>.lora_A.weight` [r, in],
    `lora_B.weight` [out, r]): an adapter folder peft, vLLM and our engine read as any other."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        head, sep, tail = name.partition(".mlp.experts.lora_")
        if not sep:
            out[name] = tensor
            continue
        projection, side = tail.rsplit("_", 1)
        for index, matrix in enumerate(tensor):
            out[f"{head}.mlp.experts.{index}.{projection}.lora_{side}.weight"] = matrix
    return out


def split_experts(state: dict[str, torch.Tensor], config=None) -> dict[str, torch.Tensor]:
    """The 3-D expert tensors in memory as the checkpoint's one matrix per expert and projection (views)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for index, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                out[f"{prefix}{index}.gate_proj.weight"] = gate
                out[f"{prefix}{index}.up_proj.weight"] = up
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for index, matrix in enumerate(tensor):
                out[f"{prefix}{index}.down_proj.weight"] = matrix
        else:
            out[name] = tensor
    return out
