"""The default RL loss (docs/loss.md) against hand-computed values, and the alignment of token logprobs."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from asyncrl.models import init_model
from asyncrl.trainer.loss import rl_loss, token_logprobs

TAU = 0.1
N = 10  # loss tokens of the whole step: more than this micro-batch holds

# Token 0 starts the sample (never a loss token); token 4 is a prompt token whose inference logprob is
# absent (-inf here); the others are sampled tokens, one case each.
PI = [1.0, 0.5, 0.1, 0.9, 0.7, 0.3, 0.2]
MU = [1.0, 0.2, 0.4, 0.6, 0.0, 0.3, 0.5]
A = [0.0, 1.0, -1.0, -1.0, 0.0, 0.5, 2.0]
MASK = [False, True, True, True, False, True, True]


def case():
    logprobs = torch.tensor([math.log(p) for p in PI], requires_grad=True)
    inference = torch.tensor([math.log(m) if m > 0 else -math.inf for m in MU])
    return logprobs, inference, torch.tensor(A), torch.tensor(MASK)


def per_token(pi: float, mu: float, a: float, kept: bool) -> float:
    r = math.log(pi) - math.log(mu)
    return -(a * math.exp(r) if kept else 0.0) + TAU * r * r


def test_loss_matches_hand_computed_values():
    loss, sums = rl_loss(*case(), total_loss_tokens=N, delta_low=0.2, delta_high=0.2, kl_tau=TAU)
    expected = (
        per_token(0.5, 0.2, 1.0, kept=False)  # A > 0 and pi - mu = 0.3 > delta_high: masked high
        + per_token(0.1, 0.4, -1.0, kept=False)  # A < 0 and mu - pi = 0.3 > delta_low: masked low
        + per_token(0.9, 0.6, -1.0, kept=True)  # A < 0 but pi > mu: kept (-A * rho = +1.5)
        + per_token(0.3, 0.3, 0.5, kept=True)  # on-policy: -A
        + per_token(0.2, 0.5, 2.0, kept=True)  # A > 0 but pi < mu: kept
    ) / N
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert sums["masked/high"].item() == 1 and sums["masked/low"].item() == 1


def test_mismatch_kl_sums_rho_minus_log_rho_minus_one_over_loss_tokens():
    _, sums = rl_loss(*case(), total_loss_tokens=N, delta_low=0.2, delta_high=0.2, kl_tau=TAU)
    pairs = [(p, m) for p, m, keep in zip(PI, MU, MASK) if keep]
    expected = sum(p / m - math.log(p / m) - 1 for p, m in pairs)
    assert sums["mismatch_kl"].item() == pytest.approx(expected, rel=1e-6)


def test_gradient_of_a_masked_token_is_only_the_kl_term():
    logprobs, *rest = case()
    loss, _ = rl_loss(logprobs, *rest, total_loss_tokens=N, delta_low=0.2, delta_high=0.2, kl_tau=TAU)
    loss.backward()
    grad = logprobs.grad.tolist()
    r1 = math.log(0.5 / 0.2)
    assert grad[1] == pytest.approx(2 * TAU * r1 / N, rel=1e-5)  # masked high: no policy-gradient term
    r3 = math.log(0.9 / 0.6)
    assert grad[3] == pytest.approx((1.0 * 1.5 + 2 * TAU * r3) / N, rel=1e-5)  # -A * rho + 2 tau r
    assert grad[0] == 0 and grad[4] == 0  # not loss tokens, even with a -inf inference logprob
    assert all(math.isfinite(g) for g in grad)


def test_loss_is_divided_by_the_global_token_count():
    half, _ = rl_loss(*case(), total_loss_tokens=2 * N, delta_low=0.2, delta_high=0.2, kl_tau=TAU)
    full, _ = rl_loss(*case(), total_loss_tokens=N, delta_low=0.2, delta_high=0.2, kl_tau=TAU)
    assert half.item() == pytest.approx(full.item() / 2, rel=1e-6)


def test_wide_trust_region_masks_nothing():
    loss, sums = rl_loss(*case(), total_loss_tokens=N, delta_low=1.0, delta_high=1.0, kl_tau=0.0)
    expected = -sum(a * p / m for p, m, a, keep in zip(PI, MU, A, MASK) if keep) / N
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert sums["masked/low"].item() == sums["masked/high"].item() == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("m") / "tiny"
    init_model(path, "tiny")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_token_logprobs_scores_token_t_with_the_logits_of_position_t_minus_1(tiny):
    ids = torch.randint(0, 259, (12,), generator=torch.Generator().manual_seed(0))
    temperature = torch.full((12,), 0.7)
    with torch.no_grad():
        logits = tiny(input_ids=ids[None], use_cache=False).logits[0]
        logprobs, entropy = token_logprobs(logits, ids, temperature)
    assert logprobs[0] == 0 and entropy[0] == 0
    for t in range(1, 12):
        dist = torch.log_softmax(logits[t - 1] / 0.7, dim=-1)
        assert logprobs[t].item() == pytest.approx(dist[ids[t]].item(), abs=1e-6)
        assert entropy[t].item() == pytest.approx(-(dist.exp() * dist).sum().item(), abs=1e-5)


def test_token_logprobs_of_a_packed_row_equal_those_of_each_sample_alone(tiny):
    generator = torch.Generator().manual_seed(1)
    lengths, temperatures = [7, 11, 5], [0.7, 1.0, 1.3]
    samples = [torch.randint(0, 259, (n,), generator=generator) for n in lengths]
    ids = torch.cat(samples)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    temperature = torch.cat([torch.full((n,), t) for n, t in zip(lengths, temperatures)])
    with torch.no_grad():
        logits = tiny(input_ids=ids[None], position_ids=position_ids[None], use_cache=False).logits[0]
        packed, packed_entropy = token_logprobs(logits, ids, temperature)
        alone = [
            token_logprobs(tiny(input_ids=s[None], use_cache=False).logits[0], s, t)
            for s, t in zip(samples, temperatures)
        ]
    inside = position_ids > 0  # a sample's first token has no logits of its own sample
    torch.testing.assert_close(packed[inside], torch.cat([lp for lp, _ in alone])[inside], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed_entropy[inside], torch.cat([h for _, h in alone])[inside], rtol=0, atol=1e-5)


def test_docs_state_the_formulas_tested_here():
    doc = (Path(__file__).parents[2] / "docs" / "loss.md").read_text()
    for formula in (
        "r_t = log π_t − log μ_t",
        "m_t = 0  if A_t > 0 and π_t − μ_t > δ_high",
        "m_t = 0  if A_t < 0 and μ_t − π_t > δ_low",
        "ℓ_t = − m_t · A_t · ρ_t  +  τ · r_t²",
        "loss = Σ_t ℓ_t / N",
        "Σ (ρ_t − r_t − 1) / N",
        "log π_t = log_softmax(z_{t−1} / T_t)[x_t]",
    ):
        assert formula in doc, formula


def test_a_step_on_the_loss_raises_rewarded_tokens_and_lowers_punished_ones(tiny):
    model = copy.deepcopy(tiny).train()
    ids = torch.randint(0, 259, (2, 10), generator=torch.Generator().manual_seed(2))
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.arange(10) >= 5

    def logprobs_of(m):
        return [token_logprobs(m(input_ids=row[None], use_cache=False).logits[0], row)[0] for row in ids]

    before = [lp.detach() for lp in logprobs_of(model)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for row_logprobs, old, a in zip(logprobs_of(model), before, advantages):
        loss, _ = rl_loss(row_logprobs, old, torch.full((10,), a.item()), mask, 10, 0.2, 0.2, 0.0)
        loss.backward()
    optimizer.step()
    after = [lp.detach() for lp in logprobs_of(model)]
    assert (after[0] - before[0])[mask].sum() > 0
    assert (after[1] - before[1])[mask].sum() < 0
