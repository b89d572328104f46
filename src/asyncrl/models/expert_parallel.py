"""Expert parallelism: each of `ep` ranks holds E / ep of every layer's routed experts, and the token-expert pairs
travel to the rank holding their expert and back, by all-to-all.

`shard_experts` makes a layer's expert weights DTensors sharded over the experts dimension of the `ep` mesh
(so checkpoints, gathered state dicts and FSDP2 see whole tensors) and gives it a `TokenDispatch`. The
dispatch, per forward (autograd runs the same exchanges backwards):

1. every rank counts its pairs per (destination rank, local expert) and the ranks swap these counts;
2. the pairs (already sorted by expert, so by destination rank) go out by one all-to-all;
3. the received pairs, which arrive by (source rank, local expert), are sorted by local expert and run
   through the local experts' grouped matrix products;
4. the results go back the same way, and the caller weighs and sums them per token as without parallelism.

Routing is computed on each rank for its own tokens, so the load-balancing statistics stay per rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from asyncrl.errors import AsyncRLError


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward sends the gradients back along the same routes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows of `x` (dim 0) sent to the ranks of `group` in blocks of `input_splits`; returns the blocks received,
    `output_splits` rows from each rank in rank order. Differentiable."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


class TokenDispatch:
    """The all-to-all exchange of one expert-parallel layer (module docstring)."""

    def __init__(self, mesh: DeviceMesh, num_experts: int):
        self.group = mesh.get_group()
        self.ep = mesh.size()
        self.local_experts = num_experts // self.ep

    @torch.compiler.disable  # sizes known only at run time: host syncs and collectives, not a graph
    def __call__(
        self,
        rows: torch.Tensor,
        counts: torch.Tensor,
        compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """rows [P, H]: this rank's pairs sorted by (global) expert, counts[e] of them for expert e. `compute`
        runs local rows sorted by local expert (given their counts); returns its outputs in `rows`' order."""
        sent = counts.view(self.ep, self.local_experts)  # [destination rank, its local expert]
        received = torch.empty_like(sent)  # [source rank, my local expert]
        dist.all_to_all_single(received, sent.contiguous(), group=self.group)
        send_splits, receive_splits = sent.sum(dim=1).tolist(), received.sum(dim=1).tolist()
        arrived = all_to_all(rows, receive_splits, send_splits, self.group)
        # Arrived in blocks (source rank, local expert); the grouped products want them by local expert.
        block = torch.repeat_interleave(torch.arange(received.numel(), device=rows.device), received.flatten())
        order = ((block % self.local_experts) * self.ep + block // self.local_experts).argsort(stable=True)
        out = compute(arrived[order], received.sum(dim=0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all(out[back], send_splits, receive_splits, self.group)


def shard_experts(experts: nn.Module, mesh: DeviceMesh) -> None:
    """Keep this rank's E / ep experts of `experts` (every rank holds the whole layer before) and route its pairs
    through a `TokenDispatch` over `mesh`."""
    num_experts = experts.num_experts
    if num_experts % mesh.size():
        raise AsyncRLError(f"trainer.ep = {mesh.size()} does not divide the model's {num_experts} experts")
    for name, weight in list(experts.named_parameters(recurse=False)):  # the weights, and LoRA adapters if any
        sharded = distribute_tensor(weight.detach(), mesh, [Shard(0)])
        setattr(experts, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
    experts.dispatch = TokenDispatch(mesh, num_experts)
