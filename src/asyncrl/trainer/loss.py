"""The RL losses (their formulas in docs/loss.md); logprobs: logprobs.py.

Every stream is aligned with `input_ids`: stream[t] describes token t. The logits that predict token t
come from position t - 1, so position 0 of a row (and of each packed sample) has no logprob of its own;
it is never a loss token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncrl.config.custom_loss import import_loss
from asyncrl.config.schema import LossConfig


@dataclass
class LossInputs:
    """One packed micro-batch as a loss sees it: [T] streams aligned with its tokens (docs/loss.md)."""

    logprobs: torch.Tensor  # log pi_t of the trainer, at the sampling temperature; carries the gradient
    inference_logprobs: torch.Tensor  # log mu_t recorded at sampling
    advantages: torch.Tensor  # A_t
    loss_mask: torch.Tensor  # bool: the tokens the policy sampled
    position_ids: torch.Tensor  # restart at 0 at each packed sample: how sequence-level losses find samples
    total_loss_tokens: int  # N: loss tokens of the whole step, all ranks and micro-batches


# (loss, sums): this micro-batch's share of the step loss (its tokens' sum of l_t, divided by N) and
# detached per-token sums for metrics, e.g. {"masked/low": ..., "masked/high": ...}.
LossFunction = Callable[[LossInputs, LossConfig], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def log_ratio(inputs: LossInputs) -> torch.Tensor:
    """r_t = log pi_t - log mu_t on loss tokens, 0 elsewhere (where mu may be absent (0) or -inf)."""
    return torch.where(inputs.loss_mask.bool(), inputs.logprobs - inputs.inference_logprobs, 0.0)


def step_share(per_token: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """Sum of l_t over this micro-batch's loss tokens, divided by the global loss-token count N."""
    return torch.where(inputs.loss_mask.bool(), per_token, 0.0).sum() / max(inputs.total_loss_tokens, 1)


def default_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked importance sampling: l_t = -m_t A_t rho_t + tau r_t^2, m_t = 0 outside the trust region."""
    mask, advantages = inputs.loss_mask.bool(), inputs.advantages
    r = log_ratio(inputs)
    with torch.no_grad():
        pi, mu = inputs.logprobs.exp(), inputs.inference_logprobs.exp()
        masked_high = mask & (advantages > 0) & (pi - mu > cfg.delta_high)
        masked_low = mask & (advantages < 0) & (mu - pi > cfg.delta_low)
        keep = mask & ~masked_high & ~masked_low
    per_token = -(keep * advantages * r.exp()) + cfg.kl_tau * r**2
    return step_share(per_token, inputs), {
        "masked/low": masked_low.sum().float(),
        "masked/high": masked_high.sum().float(),
    }


def clipped_objective(
    ratio: torch.Tensor, inputs: LossInputs, cfg: LossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's pessimistic bound, -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A) + tau r^2, for a
    per-token ratio (ppo_clip) or a per-sample one spread over its tokens (gspo)."""
    mask, advantages = inputs.loss_mask.bool(), inputs.advantages
    r = log_ratio(inputs)
    low, high = 1 - cfg.clip_low, 1 + cfg.clip_high
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    per_token = -surrogate + cfg.kl_tau * r**2
    with torch.no_grad():  # where the clipped branch wins, the token gets no policy gradient
        clipped_high = mask & (advantages > 0) & (ratio > high)
        clipped_low = mask & (advantages < 0) & (ratio < low)
    return step_share(per_token, inputs), {
        "masked/low": clipped_low.sum().float(),
        "masked/high": clipped_high.sum().float(),
    }


def ppo_clip_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level ratio rho_t = exp(r_t), clipped as in PPO."""
    return clipped_objective(log_ratio(inputs).exp(), inputs, cfg)


def gspo_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sequence-level ratio (GSPO, Zheng et al. 2025): s_i = exp(mean of r_t over sample i's loss tokens), the
    geometric mean of its token ratios, given to every token of the sample, then clipped as in PPO."""
    mask = inputs.loss_mask.bool()
    sample = torch.cumsum(inputs.position_ids == 0, dim=0) - 1  # packed sample index of each token
    num_samples = int(sample[-1]) + 1
    r = log_ratio(inputs)
    sums = r.new_zeros(num_samples).index_add(0, sample, r)
    counts = r.new_zeros(num_samples).index_add(0, sample, mask.float())
    ratio = (sums / counts.clamp(min=1)).exp()[sample]
    return clipped_objective(ratio, inputs, cfg)


BUILT_IN: dict[str, LossFunction] = {"default": default_loss, "ppo_clip": ppo_clip_loss, "gspo": gspo_loss}


def rl_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step loss under `cfg.type`, plus per-token sums for metrics.

    Summing the returned losses over micro-batches and ranks gives the loss of the step, however rows were
    packed. The sums (mismatch_kl, masked/low, masked/high) are detached; divide their global sums by N.
    """
    function = import_loss(cfg.custom) if cfg.type == "custom" else BUILT_IN[cfg.type]
    loss, sums = function(inputs, cfg)
    with torch.no_grad():
        r = log_ratio(inputs)
        mismatch_kl = torch.where(inputs.loss_mask.bool(), r.exp() - r - 1, 0.0).sum()
    zero = mismatch_kl.new_zeros(())
    return loss, {"mismatch_kl": mismatch_kl, "masked/low": zero, "masked/high": zero, **sums}
