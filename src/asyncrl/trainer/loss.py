"""Per-token logprobs and the default RL loss (DESIGN.md "The default loss"; formulas in docs/loss.md).

Every stream is aligned with `input_ids`: stream[t] describes token t. The logits that predict token t
come from position t - 1, so position 0 of a row (and of each packed sample) has no logprob of its own;
it is never a loss token.
"""

from __future__ import annotations

import torch


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: torch.Tensor | float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / T) of each token of a row, and the entropy of the distribution it was drawn from.

    logits: [T, V] for one (packed) row; input_ids: [T]; temperature: scalar or [T] (the temperature
    token t was sampled at). Returns two float32 [T] tensors aligned with input_ids; index 0 is 0.
    At the first token of a later packed sample the values are meaningless (its logits come from the
    previous sample); the loss mask excludes them.
    """
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    if temperature.dim() == 1:
        temperature = temperature[1:, None]
    scaled = logits[:-1].float() / temperature
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    logprobs = logprobs_all.gather(-1, input_ids[1:, None]).squeeze(-1)
    with torch.no_grad():  # a metric: no need to keep its graph
        entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
    zero = logprobs.new_zeros(1)
    return torch.cat([zero, logprobs]), torch.cat([zero, entropy])


def rl_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    total_loss_tokens: int,
    delta_low: float,
    delta_high: float,
    kl_tau: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the global loss: sum over its loss tokens of l_t, divided by N.

    N (`total_loss_tokens`) counts the loss tokens of the whole step on all ranks, so summing the
    returned losses over micro-batches and ranks gives the loss of the step, however rows were packed.
    Also returns detached per-token sums (mismatch_kl, masked/low, masked/high) for metrics; divide
    their global sums by N.
    """
    mask = loss_mask.bool()
    # Zero outside the loss tokens, where inference logprobs may be absent (0) or -inf: exp must stay finite.
    log_ratio = torch.where(mask, logprobs - inference_logprobs, 0.0)
    ratio = log_ratio.exp()
    with torch.no_grad():
        pi, mu = logprobs.exp(), inference_logprobs.exp()
        masked_high = mask & (advantages > 0) & (pi - mu > delta_high)
        masked_low = mask & (advantages < 0) & (mu - pi > delta_low)
        keep = mask & ~masked_high & ~masked_low
    per_token = -(keep * advantages * ratio) + kl_tau * log_ratio**2
    loss = torch.where(mask, per_token, 0.0).sum() / max(total_loss_tokens, 1)
    with torch.no_grad():
        mismatch_kl = torch.where(mask, ratio - log_ratio - 1, 0.0).sum()
    sums = {
        "mismatch_kl": mismatch_kl,
        "masked/low": masked_low.sum().float(),
        "masked/high": masked_high.sum().float(),
    }
    return loss, sums
