"""The mixture-of-experts side of a train step: the load-balancing loss each row adds, and the step's routing
metrics (the `moe/` names of docs/metrics.md). Dense models have no routing, and none of this runs for them.

A row's routing summaries (`models/moe.py`, `summarize`) hold per MoE layer sums over its tokens: the token
count, the router's entropy, its probability of each expert and the token-expert pairs of each expert. The
loss a row adds is `coef` x the mean over layers of its balancing loss x its share of the step's tokens, so
that the rows of all ranks add up to the token-weighted mean over the step, however the rows were packed.

With context parallelism each rank of a group runs a slice of the row: the slices' summaries are summed over
the group into the row's, and each rank adds its slice's share of the row's balancing loss (`moe.balance`
with its own probabilities), so the group adds exactly the row's loss, with each gradient on its own tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from asyncrl.models.context_parallel import ContextParallel
from asyncrl.models.moe import balance, summary_parts
from asyncrl.trainer.distributed import all_reduce_sum


class RowRouting(NamedTuple):
    summary: torch.Tensor  # [MoE layers, 2 + 2E] the whole row's routing summaries, without gradient
    balance: torch.Tensor  # [MoE layers] this rank's share of the row's balancing loss, differentiable


def row_routing(summary: torch.Tensor, cp: ContextParallel | None = None) -> RowRouting:
    """The row's routing from the model's summaries of this rank's tokens (a collective of the group with `cp`)."""
    if cp is None:
        return RowRouting(summary.detach(), balance(summary))
    whole = summary.detach().clone()
    dist.all_reduce(whole, group=cp.group)
    return RowRouting(whole, balance(whole, summary_parts(summary)[2]))


def balance_loss(routing: RowRouting, coef: float, step_tokens: int) -> torch.Tensor | float:
    """This rank's share of the step's load-balancing loss from one row (0 without a coefficient)."""
    if not coef:
        return 0.0
    return coef * routing.balance.mean() * (routing.summary[0, 0] / max(step_tokens, 1))


class RoutingMetrics:
    """Sums of a step's routing over its rows, on the device (no host sync per row); `metrics` reduces them over
    ranks (a collective, which every rank runs, whether or not it added rows)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.moe_layers: list[int] = list(getattr(model, "moe_layers", []))
        moe = getattr(getattr(model, "spec", None), "moe", None)
        self.sums: torch.Tensor | None = None  # [layers, 3 + E]: tokens, balance x tokens, entropy, pairs per expert
        if self.moe_layers and moe is not None:
            self.sums = torch.zeros(len(self.moe_layers), 3 + moe.num_experts, device=device)

    def add(self, routing: RowRouting | None) -> None:
        if routing is None or self.sums is None:
            return
        summary = routing.summary.detach()
        tokens, entropy, _, counts = summary_parts(summary)
        self.sums += torch.cat([tokens[:, None], (balance(summary) * tokens)[:, None], entropy[:, None], counts], 1)

    def metrics(self) -> dict[str, float]:
        if self.sums is None:
            return {}
        sums = all_reduce_sum(self.sums).cpu()
        tokens = max(float(sums[0, 0]), 1.0)
        counts = sums[:, 3:]
        imbalance = (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)).tolist()
        metrics = {
            "moe/aux_loss": float(sums[:, 1].mean()) / tokens,
            "moe/router_entropy": float(sums[:, 2].mean()) / tokens,
            "moe/load_imbalance": sum(imbalance) / len(imbalance),
            "moe/load_imbalance_max": max(imbalance),
        }
        metrics.update({f"moe/layer_{layer}/load_imbalance": value for layer, value in zip(self.moe_layers, imbalance)})
        return metrics
