"""avg@n and pass@k as docs/evals.md states them, against values computed by hand."""

from __future__ import annotations

import pytest

from asyncrl.config.schema import EvalConfig
from asyncrl.evals.metrics import EvalSample, pass_at_k, passes, summarize


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 1 / 4),  # 1 - C(3,1)/C(4,1) = 1 - 3/4
        (4, 1, 2, 1 / 2),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 2, 3, 9 / 10),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (8, 3, 4, 13 / 14),  # 1 - C(5,4)/C(8,4) = 1 - 5/70
        (4, 0, 4, 0.0),  # nothing passes
        (4, 3, 2, 1.0),  # only one sample fails: any two include a pass
    ],
)
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_1_is_the_fraction_passing_and_pass_at_n_is_any_pass():
    for c in range(6):
        assert pass_at_k(5, c, 1) == pytest.approx(c / 5)
        assert pass_at_k(5, c, 5) == (1.0 if c else 0.0)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_an_errored_rollout_fails_whatever_its_reward():
    assert passes(1.0, None, 1.0)
    assert not passes(0.99, None, 1.0)
    assert not passes(1.0, "similarity raised", 1.0)


def sample(example: int, index: int, reward: float, passed: bool, error: str | None = None) -> EvalSample:
    return EvalSample(
        env="reverse_text", example=example, sample=index, prompt="abc", answer="cba", completion="cba",
        reward=reward, passed=passed, metrics={"exact_match": float(passed)}, error=error, finish_reason="stop",
        turns=1, is_truncated=index == 3, completion_tokens=4, policy_version=0, messages=[],
    )  # fmt: skip


def test_summary_averages_rewards_and_pass_at_k_over_examples():
    samples = [
        sample(0, 0, 1.0, True), sample(0, 1, 0.0, False), sample(0, 2, 0.5, False), sample(0, 3, 1.0, True),
        sample(1, 0, 0.0, False), sample(1, 1, 0.0, False, error="boom"), sample(1, 2, 0.25, False),
        sample(1, 3, 0.0, False),
    ]  # fmt: skip
    summary = summarize(samples, n=4, ks=[1, 2, 4])
    assert summary["examples"] == 2
    assert summary["rollouts"] == 8
    assert summary["errored"] == 1
    assert summary["truncated"] == 2
    assert summary["avg@4"] == pytest.approx((1 + 0 + 0.5 + 1 + 0 + 0 + 0.25 + 0) / 8)
    assert summary["pass@1"] == pytest.approx((2 / 4 + 0) / 2)
    assert summary["pass@2"] == pytest.approx((5 / 6 + 0) / 2)
    assert summary["pass@4"] == pytest.approx((1 + 0) / 2)
    assert summary["mean/exact_match"] == pytest.approx(2 / 8)


def test_summary_refuses_examples_with_missing_samples():
    with pytest.raises(ValueError, match="exactly n = 4"):
        summarize([sample(0, 0, 1.0, True)], n=4, ks=[1])


def test_pass_at_defaults_to_1_and_n_and_k_may_not_exceed_n():
    config = EvalConfig(environments={"reverse_text": {}}, samples_per_example=8)
    assert config.pass_ks == [1, 8]
    with pytest.raises(ValueError, match="between 1 and samples_per_example"):
        EvalConfig(environments={"reverse_text": {}}, samples_per_example=4, pass_at=[8])
