"""Per-token logprobs and entropies of a packed row, computed through the LM head chunk by chunk.

A [tokens x vocab] float32 logits tensor is the largest thing a training step makes: 65,536 tokens x
151,936 ids is 40 GB. So the trained model returns its final hidden states (`HiddenStatesHead` stands in
for the LM head) and `chunked_token_logprobs` projects `chunk_size` positions at a time, in the forward
and again in the backward, keeping one chunk's logits alive at a time.

Every stream is aligned with `input_ids`: stream[t] describes token t. The logits that predict token t
come from position t - 1, so position 0 of a row (and of each packed sample) has no logprob of its own;
index 0 is 0, and at the first token of a later packed sample the values are meaningless (they come from
the previous sample); the loss mask excludes both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from asyncrl.errors import AsyncRLError
from asyncrl.models.context_parallel import ContextParallel, gather_slices
from asyncrl.trainer.attention import attention_kwargs
from asyncrl.trainer.routing import RowRouting, row_routing


class HiddenStatesHead(nn.Module):
    """Holds the LM head's weight (same parameter, so tied embeddings stay tied and the state dict keeps
    `lm_head.weight`) but returns the hidden states: the model's `.logits` output is then [.., hidden]."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # A copy, not the view transformers hands in: FSDP2 hooks the root's output for the backward and
        # warns that an in-place op on a view would lose that hook. [T, hidden] is small next to logits.
        return hidden_states.clone()


def defer_lm_head(model: PreTrainedModel) -> None:
    """Replace the model's LM head by a `HiddenStatesHead`, so logits are only ever made in chunks."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise AsyncRLError(
            f"{type(model).__name__}'s output layer is not a bias-free linear LM head, so its logprobs cannot be "
            "computed in chunks (use a Llama/Qwen-style causal LM)"
        )
    model.set_output_embeddings(HiddenStatesHead(head.weight))


def _chunk_forward(
    logits: torch.Tensor, targets: torch.Tensor, inv_temperature: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One chunk's logprobs of the targets, entropies (or None) and log-sum-exps, from its raw logits (a
    fresh matmul output, which this may overwrite). In place where it can: eager, each [chunk x vocab]
    float32 temporary is 1.2 GB at 2,048 x 151,936."""
    scaled = logits.float().mul_(inv_temperature[:, None])
    lse = torch.logsumexp(scaled, dim=-1)
    logprobs = scaled.gather(-1, targets[:, None]).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        log_p = scaled.sub_(lse[:, None])
        entropy = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropy, lse


def _chunk_backward(
    logits: torch.Tensor, targets: torch.Tensor, inv_temperature: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """d loss / d raw logits of one chunk, in the logits' dtype: (onehot(target) - softmax) * grad / T.
    In place on one float32 temporary, as the forward."""
    scale, grad = inv_temperature[:, None], grad[:, None]
    probs = logits.float().mul_(scale).sub_(lse[:, None]).exp_()
    return probs.mul_(-grad).scatter_add_(-1, targets[:, None], grad).mul_(scale).to(logits.dtype)


# Compiled, each of the two is one or two fused kernels over the chunk's [chunk x vocab] logits; eager, it is
# about eight passes over them, each as large as the logits in float32 (1.2 GB for 2,048 x 151,936).
_COMPILED: dict[str, object] = {}


def _kernels(compiled: bool):
    if not compiled:
        return _chunk_forward, _chunk_backward
    if not _COMPILED:
        _COMPILED["forward"] = torch.compile(_chunk_forward, dynamic=True)
        _COMPILED["backward"] = torch.compile(_chunk_backward, dynamic=True)
    return _COMPILED["forward"], _COMPILED["backward"]


class _ChunkedLogprobs(torch.autograd.Function):
    """logprob[t] = log softmax(h[t] W^T / T_t)[target t], and its entropy, one chunk of rows at a time.

    The backward recomputes each chunk's logits from h, W and the saved log-sum-exp; the entropy is a
    metric and carries no gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temperature, chunk_size, with_entropy, compiled):
        forward_chunk, _ = _kernels(compiled)
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros_like(logprobs)
        lse = torch.empty_like(logprobs)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logits = hidden[start:end] @ weight.T
            chunk = forward_chunk(logits, targets[start:end], inv_temperature[start:end], with_entropy)
            logprobs[start:end], lse[start:end] = chunk[0], chunk[2]
            if with_entropy:
                entropy[start:end] = chunk[1]
        ctx.save_for_backward(hidden, weight, targets, inv_temperature, lse)
        ctx.chunk_size, ctx.compiled = chunk_size, compiled
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, inv_temperature, lse = ctx.saved_tensors
        _, backward_chunk = _kernels(ctx.compiled)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:end]
            grad_logits = backward_chunk(
                h @ weight.T, targets[start:end], inv_temperature[start:end], lse[start:end], grad_logprobs[start:end]
            )
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                grad_weight += grad_logits.T @ h
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: torch.Tensor | float = 1.0,
    chunk_size: int = 2048,
    with_entropy: bool = True,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(h W^T / T) of each token of a row, and the entropy of the distribution it was drawn from.

    hidden: [T, H] final hidden states of one (packed) row; lm_head_weight: [V, H]; input_ids: [T];
    temperature: scalar or [T] (the temperature token t was sampled at). Returns two float32 [T] tensors
    aligned with input_ids (module docstring). Equals `token_logprobs(hidden @ W^T, ...)`, values and
    gradients, without ever holding more than `chunk_size` x V logits. `with_entropy=False` (SFT) skips
    the entropy (returned as zeros); `compiled=True` runs each chunk's softmax math as compiled kernels.
    """
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=hidden.device)
    inv_temperature = (1.0 / temperature).expand(input_ids.shape)[1:].contiguous()
    logprobs, entropy = _ChunkedLogprobs.apply(
        hidden[:-1], lm_head_weight, input_ids[1:], inv_temperature, chunk_size, with_entropy, compiled
    )
    zero = logprobs.new_zeros(1)
    return torch.cat([zero, logprobs]), torch.cat([zero, entropy])


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: torch.Tensor | float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from full [T, V] logits: the plain computation, the reference the chunked one must equal."""
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    if temperature.dim() == 1:
        temperature = temperature[1:, None]
    logprobs_all = torch.log_softmax(logits[:-1].float() / temperature, dim=-1)
    logprobs = logprobs_all.gather(-1, input_ids[1:, None]).squeeze(-1)
    with torch.no_grad():  # a metric: no need to keep its graph
        entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
    zero = logprobs.new_zeros(1)
    return torch.cat([zero, logprobs]), torch.cat([zero, entropy])


class RowLogprobs(NamedTuple):
    logprobs: torch.Tensor  # [T] float32
    entropy: torch.Tensor  # [T] float32
    routing: RowRouting | None  # the row's routing (trainer/routing.py); None for dense models


def row_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: torch.Tensor | float = 1.0,
    chunk_size: int = 2048,
    with_entropy: bool = True,
    compiled: bool = False,
    routed_experts: torch.Tensor | None = None,
) -> RowLogprobs:
    """Forward one packed row ([T] ids, positions restarting at 0 per sample) of a model whose LM head was
    deferred (`defer_lm_head`); returns its per-token logprobs and entropies, and for a mixture-of-experts
    model of ours its routing summaries. `routed_experts` [T, MoE layers, k]: the experts to route each
    token to (router replay; -1 where none was recorded). With context parallelism (`sliced_row_logprobs`)
    every rank of the group returns the whole row's streams.

    The model is called as a whole, never `model.model` alone: under FSDP2 the root module's forward hook
    is what gathers the embeddings, final norm and LM head, and it leaves them gathered for the backward,
    so `lm_head.weight` below is the full (unsharded) weight.
    """
    cp = getattr(model, "context_parallel", None)
    if cp is not None:
        return sliced_row_logprobs(
            model, cp, input_ids, position_ids, temperature, chunk_size, with_entropy, compiled, routed_experts
        )
    output = forward_hidden(model, input_ids, position_ids, position_ids, routed_experts)
    logprobs, entropy = chunked_token_logprobs(
        output.logits[0], lm_head_weight(model), input_ids, temperature, chunk_size, with_entropy, compiled
    )
    return RowLogprobs(logprobs, entropy, routing_of(output))


def forward_hidden(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    row_position_ids: torch.Tensor,
    routed_experts: torch.Tensor | None,
    routing_mask: torch.Tensor | None = None,
):
    """The model's output (final hidden states as `.logits`) for `input_ids` at `position_ids`, attending as
    the documents of `row_position_ids` (the whole row's; the same tensor but with context parallelism);
    `routing_mask`: the tokens its routing summaries count (context parallelism: not the padding)."""
    extra = {} if routed_experts is None else {"routed_experts": routed_experts}
    if routing_mask is not None:
        extra["routing_mask"] = routing_mask
    # use_cache=False: only then does transformers keep packed samples apart.
    return model(
        input_ids=input_ids[None],
        position_ids=position_ids[None],
        use_cache=False,
        **extra,
        **attention_kwargs(model, row_position_ids),
    )


def routing_of(output, cp: ContextParallel | None = None) -> RowRouting | None:
    """The row's routing from a forward's summaries (a mixture-of-experts model of ours), else None."""
    summary = getattr(output, "routing", None)
    return None if summary is None else row_routing(summary, cp)


def lm_head_weight(model: PreTrainedModel) -> torch.Tensor:
    weight = model.get_output_embeddings().weight
    if isinstance(weight, DTensor):
        raise AsyncRLError("the LM head weight is still sharded after the forward (FSDP2 resharded the root module)")
    return weight


def sliced_row_logprobs(
    model: PreTrainedModel,
    cp: ContextParallel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: torch.Tensor | float,
    chunk_size: int,
    with_entropy: bool,
    compiled: bool,
    routed_experts: torch.Tensor | None,
) -> RowLogprobs:
    """`row_logprobs` on one rank of a context-parallel group: every rank of it holds the same row and runs the
    model on its own contiguous slice (rotary positions from the row's `position_ids`, attention over the
    whole row's documents). The row is padded to a multiple of the group's size with a document of its own
    after the row's last, which causal document attention keeps from every real token.

    The logits at position t predict token t + 1, so the targets are shifted over the whole row before it is
    sliced: each rank scores the targets of its own positions, the first token of the next rank's slice
    included, and no hidden state crosses a slice boundary. The slices' logprobs and entropies are then
    gathered, so every rank of the group computes the same whole-row loss; the gradient flows back through
    each rank's own slice (`gather_slices`)."""
    tokens = input_ids.numel()
    padding = cp.padded(tokens) - tokens
    own = cp.own(tokens)
    row_positions = torch.cat([position_ids, torch.arange(padding, device=position_ids.device)])
    padded_ids = F.pad(input_ids, (0, padding))
    targets = F.pad(padded_ids[1:], (0, 1))  # targets[t] = token t + 1; the last position predicts nothing
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=input_ids.device)
    inv_temperature = F.pad((1.0 / temperature).expand(input_ids.shape)[1:], (0, padding + 1), value=1.0)
    replay = None
    if routed_experts is not None:
        replay = F.pad(routed_experts, (0, 0, 0, 0, 0, padding), value=-1)[own]
    real = torch.arange(own.start, own.stop, device=input_ids.device) < tokens
    output = forward_hidden(model, padded_ids[own], row_positions[own], row_positions, replay, real)
    logprobs, entropy = _ChunkedLogprobs.apply(
        output.logits[0],
        lm_head_weight(model),
        targets[own],
        inv_temperature[own].contiguous(),
        chunk_size,
        with_entropy,
        compiled,
    )
    row = gather_slices(torch.stack([logprobs, entropy]), cp)[:, : tokens - 1]  # [2, T - 1]: tokens 1 .. T - 1
    row = F.pad(row, (1, 0))  # token 0 has no logprob (module docstring)
    return RowLogprobs(row[0], row[1], routing_of(output, cp))


def compute_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: torch.Tensor | float = 1.0,
    chunk_size: int = 2048,
    with_entropy: bool = True,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`row_logprobs` without the routing: per-token logprobs and entropies."""
    row = row_logprobs(model, input_ids, position_ids, temperature, chunk_size, with_entropy, compiled)
    return row.logprobs, row.entropy
