"""The RL losses (docs/loss.md) against hand-computed values, and the alignment of token logprobs."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from asyncrl.config.schema import LossConfig
from asyncrl.models.offline import init_model
from asyncrl.trainer.logprobs import token_logprobs
from asyncrl.trainer.loss import LossInputs, rl_loss

TAU = 0.1
N = 10  # loss tokens of the whole step: more than this micro-batch holds

# Token 0 starts the sample (never a loss token); token 4 is a prompt token whose inference logprob is
# absent (-inf here); the others are sampled tokens, one case each.
PI = [1.0, 0.5, 0.1, 0.9, 0.7, 0.3, 0.2]
MU = [1.0, 0.2, 0.4, 0.6, 0.0, 0.3, 0.5]
A = [0.0, 1.0, -1.0, -1.0, 0.0, 0.5, 2.0]
MASK = [False, True, True, True, False, True, True]


def case(pi=PI, mu=MU, a=A, mask=MASK, position_ids=None, total_loss_tokens=N) -> LossInputs:
    return LossInputs(
        logprobs=torch.tensor([math.log(p) for p in pi], requires_grad=True),
        inference_logprobs=torch.tensor([math.log(m) if m > 0 else -math.inf for m in mu]),
        advantages=torch.tensor(a),
        loss_mask=torch.tensor(mask),
        position_ids=torch.arange(len(pi)) if position_ids is None else torch.tensor(position_ids),
        total_loss_tokens=total_loss_tokens,
    )


def config(**overrides) -> LossConfig:
    return LossConfig(**{"kl_tau": TAU, **overrides})


def kl(pi: float, mu: float) -> float:
    return TAU * math.log(pi / mu) ** 2


def per_token(pi: float, mu: float, a: float, kept: bool) -> float:
    r = math.log(pi) - math.log(mu)
    return -(a * math.exp(r) if kept else 0.0) + TAU * r * r


def test_loss_matches_hand_computed_values():
    loss, sums = rl_loss(case(), config())
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
    expected = sum(p / m - math.log(p / m) - 1 for p, m, keep in zip(PI, MU, MASK) if keep)
    for loss_type in ("default", "ppo_clip", "gspo"):
        _, sums = rl_loss(case(), config(type=loss_type))
        assert sums["mismatch_kl"].item() == pytest.approx(expected, rel=1e-6), loss_type


def test_gradient_of_a_masked_token_is_only_the_kl_term():
    inputs = case()
    loss, _ = rl_loss(inputs, config())
    loss.backward()
    grad = inputs.logprobs.grad.tolist()
    r1 = math.log(0.5 / 0.2)
    assert grad[1] == pytest.approx(2 * TAU * r1 / N, rel=1e-5)  # masked high: no policy-gradient term
    r3 = math.log(0.9 / 0.6)
    assert grad[3] == pytest.approx((1.0 * 1.5 + 2 * TAU * r3) / N, rel=1e-5)  # -A * rho + 2 tau r
    assert grad[0] == 0 and grad[4] == 0  # not loss tokens, even with a -inf inference logprob
    assert all(math.isfinite(g) for g in grad)


@pytest.mark.parametrize("loss_type", ["default", "ppo_clip", "gspo"])
def test_loss_is_divided_by_the_global_token_count(loss_type):
    half, _ = rl_loss(case(total_loss_tokens=2 * N), config(type=loss_type))
    full, _ = rl_loss(case(), config(type=loss_type))
    assert half.item() == pytest.approx(full.item() / 2, rel=1e-6)


def test_wide_trust_region_masks_nothing():
    loss, sums = rl_loss(case(), config(delta_low=1.0, delta_high=1.0, kl_tau=0.0))
    expected = -sum(a * p / m for p, m, a, keep in zip(PI, MU, A, MASK) if keep) / N
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert sums["masked/low"].item() == sums["masked/high"].item() == 0


def test_ppo_clip_matches_hand_computed_values():
    loss, sums = rl_loss(case(), config(type="ppo_clip", clip_low=0.2, clip_high=0.2))
    per_token_losses = [
        -min(2.5 * 1.0, 1.2 * 1.0) + kl(0.5, 0.2),  # rho = 2.5, A > 0: clipped at 1.2 (clipped high)
        -min(0.25 * -1.0, 0.8 * -1.0) + kl(0.1, 0.4),  # rho = 0.25, A < 0: clipped at 0.8 (clipped low)
        -min(1.5 * -1.0, 1.2 * -1.0) + kl(0.9, 0.6),  # rho = 1.5, A < 0: the unclipped -1.5 is the minimum
        -min(1.0 * 0.5, 1.0 * 0.5) + kl(0.3, 0.3),  # on-policy
        -min(0.4 * 2.0, 0.8 * 2.0) + kl(0.2, 0.5),  # rho = 0.4, A > 0: the unclipped 0.8 is the minimum
    ]
    expected = sum(per_token_losses) / N
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert sums["masked/high"].item() == 1 and sums["masked/low"].item() == 1


def test_ppo_clip_gives_clipped_tokens_only_the_kl_gradient():
    inputs = case()
    loss, _ = rl_loss(inputs, config(type="ppo_clip"))
    loss.backward()
    grad = inputs.logprobs.grad.tolist()
    assert grad[1] == pytest.approx(2 * TAU * math.log(2.5) / N, rel=1e-5)  # clipped high
    assert grad[2] == pytest.approx(2 * TAU * math.log(0.25) / N, rel=1e-5)  # clipped low
    assert grad[6] == pytest.approx((-2.0 * 0.4 + 2 * TAU * math.log(0.4)) / N, rel=1e-5)  # -A rho + 2 tau r


# Two packed samples for the sequence-level ratio: sample a (tokens 0-3) has loss tokens 1, 2 with token
# ratios 4 and 1 (geometric mean 2); sample b (tokens 4-7) has loss tokens 6, 7 with ratios 0.9 and 0.4
# (geometric mean 0.6); token 5 is a prompt token of b.
SEQ_PI = [1.0, 0.8, 0.5, 0.7, 1.0, 0.6, 0.45, 0.2]
SEQ_MU = [1.0, 0.2, 0.5, 0.0, 1.0, 0.6, 0.5, 0.5]
SEQ_MASK = [False, True, True, False, False, False, True, True]
SEQ_POSITIONS = [0, 1, 2, 3, 0, 1, 2, 3]


def sequence_case(advantage_a: float, advantage_b: float) -> LossInputs:
    a = [0.0, advantage_a, advantage_a, 0.0, 0.0, 0.0, advantage_b, advantage_b]
    return case(SEQ_PI, SEQ_MU, a, SEQ_MASK, SEQ_POSITIONS)


def test_gspo_gives_every_token_the_clipped_geometric_mean_ratio_of_its_sample():
    loss, sums = rl_loss(sequence_case(1.0, -1.0), config(type="gspo", clip_low=0.2, clip_high=0.2))
    token_kl = kl(0.8, 0.2) + kl(0.5, 0.5) + kl(0.45, 0.5) + kl(0.2, 0.5)
    expected = (
        2 * -min(2.0 * 1.0, 1.2 * 1.0)  # sample a: s = 2, A > 0: clipped at 1.2 on both tokens
        + 2 * -min(0.6 * -1.0, 0.8 * -1.0)  # sample b: s = 0.6, A < 0: clipped at 0.8 on both tokens
        + token_kl
    ) / N
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert sums["masked/high"].item() == 2 and sums["masked/low"].item() == 2


def test_gspo_unclipped_gradient_spreads_the_sample_ratio_over_its_tokens():
    inputs = sequence_case(1.0, 1.0)  # sample a clipped (s = 2 > 1.2, A > 0); sample b not (s = 0.6)
    loss, _ = rl_loss(inputs, config(type="gspo", kl_tau=0.0))
    assert loss.item() == pytest.approx((-2 * 1.2 - 2 * 0.6) / N, rel=1e-6)
    loss.backward()
    grad = inputs.logprobs.grad.tolist()
    # d(-2 s A)/d log pi_t with s = exp(mean of r over the sample's 2 tokens): -2 A s / 2 = -0.6.
    assert grad[6] == pytest.approx(-0.6 / N, rel=1e-5) and grad[7] == pytest.approx(-0.6 / N, rel=1e-5)
    assert grad[1] == grad[2] == 0  # sample a is clipped: no policy gradient
    assert grad[5] == 0  # a prompt token


CUSTOM_LOSS = """
import torch

def reinforce(inputs, cfg):
    mask = inputs.loss_mask.bool()
    loss = -torch.where(mask, inputs.advantages * inputs.logprobs, 0.0).sum() / inputs.total_loss_tokens
    return loss, {"masked/high": mask.sum().float()}
"""


def test_custom_loss_is_imported_by_path_and_gets_the_shared_metrics(tmp_path, monkeypatch):
    (tmp_path / "my_losses.py").write_text(CUSTOM_LOSS)
    monkeypatch.syspath_prepend(str(tmp_path))
    loss, sums = rl_loss(case(), config(type="custom", custom="my_losses:reinforce"))
    expected = -sum(a * math.log(p) for p, a, keep in zip(PI, A, MASK) if keep) / N
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert sums["masked/high"].item() == 5 and sums["masked/low"].item() == 0
    assert sums["mismatch_kl"].item() > 0


@pytest.mark.parametrize(
    ("custom", "message"),
    [
        ("no_colon", "must look like"),
        ("no_such_module_xyz:f", "cannot import"),
        ("math:no_such_function", "no function"),
    ],
)
def test_bad_custom_loss_path_fails_when_the_config_loads(custom, message):
    with pytest.raises(ValidationError, match=message):
        LossConfig(type="custom", custom=custom)


def test_custom_path_without_custom_type_is_refused():
    with pytest.raises(ValidationError, match="exactly when loss.type = 'custom'"):
        LossConfig(custom="math:sqrt")


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
        "ℓ_t = − min(ρ_t · A_t, clip(ρ_t, 1 − ε_low, 1 + ε_high) · A_t)  +  τ · r_t²",
        "s_i = exp( Σ_{t ∈ i} r_t / |i| )",
        "ℓ_t = − min(s_i · A_t, clip(s_i, 1 − ε_low, 1 + ε_high) · A_t)  +  τ · r_t²",
        "def my_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]",
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
        inputs = LossInputs(row_logprobs, old, torch.full((10,), a.item()), mask, torch.arange(10), 10)
        loss, _ = rl_loss(inputs, LossConfig(kl_tau=0.0))
        loss.backward()
    optimizer.step()
    after = [lp.detach() for lp in logprobs_of(model)]
    assert (after[0] - before[0])[mask].sum() > 0
    assert (after[1] - before[1])[mask].sum() < 0
