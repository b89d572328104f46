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

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from asyncrl.errors import AsyncRLError
from asyncrl.trainer.attention import attention_kwargs


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


def compute_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: torch.Tensor | float = 1.0,
    chunk_size: int = 2048,
    with_entropy: bool = True,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward one packed row ([T] ids, positions restarting at 0 per sample) of a model whose LM head was
    deferred (`defer_lm_head`); returns its per-token logprobs and entropies.

    The model is called as a whole, never `model.model` alone: under FSDP2 the root module's forward hook
    is what gathers the embeddings, final norm and LM head, and it leaves them gathered for the backward,
    so `lm_head.weight` below is the full (unsharded) weight.
    """
    # use_cache=False: only then does transformers keep packed samples apart.
    output = model(
        input_ids=input_ids[None],
        position_ids=position_ids[None],
        use_cache=False,
        **attention_kwargs(model, position_ids),
    )
    weight = model.get_output_embeddings().weight
    if isinstance(weight, DTensor):
        raise AsyncRLError("the LM head weight is still sharded after the forward (FSDP2 resharded the root module)")
    return chunked_token_logprobs(output.logits[0], weight, input_ids, temperature, chunk_size, with_entropy, compiled)
