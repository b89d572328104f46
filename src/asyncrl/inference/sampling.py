"""Choose the next token of every row of a batch, and record its log-probability.

The recorded log-probability is log_softmax(logits / temperature)[token]: the distribution at the
sampling temperature, taken BEFORE top-k / top-p filtering. The trainer recomputes exactly this quantity
with teacher forcing (one forward pass, same temperature, no filtering), so the two sides of the
importance ratio in the loss measure the same thing. Filtering only narrows which tokens can be drawn.

Temperature 0 means greedy decoding; its log-probabilities are taken at temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SampledTokens:
    token_ids: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B] float32
    top_ids: torch.Tensor  # [B, K] long, K = the largest top_logprobs asked for in the batch (may be 0)
    top_logprobs: torch.Tensor  # [B, K] float32


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generators: list[torch.Generator],
    num_top: int = 0,
) -> SampledTokens:
    """`logits` [B, V]; `temperature`, `top_p` [B] float; `top_k` [B] long (0 = no limit); one generator per
    row, so that a row's draws depend only on its own seed, never on what else shares the batch."""
    greedy = temperature == 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    logprobs = torch.log_softmax(logits.float() / scale[:, None], dim=-1)
    filtered = filter_top_k_top_p(logprobs, top_k, top_p)

    token_ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for row, generator in enumerate(generators):
        if greedy[row]:
            token_ids[row] = logprobs[row].argmax()
        else:
            token_ids[row] = torch.multinomial(filtered[row].exp(), 1, generator=generator)[0]

    chosen = logprobs.gather(-1, token_ids[:, None])[:, 0]
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return SampledTokens(token_ids, chosen, top_ids, top_logprobs)


def filter_top_k_top_p(logprobs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Renormalized log-probabilities with everything outside each row's top-k, then top-p nucleus set to
    -inf. The most likely token always survives. Rows without limits are returned unchanged."""
    vocab = logprobs.shape[-1]
    limited = (top_k > 0) & (top_k < vocab) | (top_p < 1)
    if not limited.any():
        return logprobs
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logprobs.device)
    k = torch.where(top_k > 0, top_k, vocab)
    sorted_lp = sorted_lp.masked_fill(rank >= k[:, None], float("-inf"))
    # top-p acts on the distribution left by top-k (as in Hugging Face and vLLM): drop a token when the
    # tokens ranked above it already hold top_p of the mass.
    probs = torch.softmax(sorted_lp, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_lp = sorted_lp.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    kept = torch.full_like(logprobs, float("-inf")).scatter(-1, order, sorted_lp)
    kept = torch.log_softmax(kept, dim=-1)
    return torch.where(limited[:, None], kept, logprobs)
