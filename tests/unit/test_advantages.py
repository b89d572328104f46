"""The formulas of docs/algorithms.md on hand-computed values."""

import pytest

from asyncrl.config import ConfigError, OrchestratorConfig, load
from asyncrl.config.schema import AdvantageConfig
from asyncrl.environments.base import Example, Rollout, TokenSample
from asyncrl.orchestrator.advantages import (
    carries_signal,
    group_advantages,
    grpo_advantages,
    length_penalized,
    rloo_advantages,
)
from asyncrl.orchestrator.batch import Batch, min_policy_version
from asyncrl.orchestrator.dispatcher import GroupTicket, score_group


def test_grpo_advantage_is_reward_minus_group_mean():
    assert grpo_advantages([1.0, 0.0, 0.5, 0.5]) == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_std_normalised_advantages_have_unit_spread():
    advantages = grpo_advantages([1.0, 0.0, 1.0, 0.0], std_normalize=True)
    assert advantages == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)


def test_rloo_baseline_leaves_the_rollout_itself_out():
    # r = [1, 0, 0, 0]: A_1 = 1 - (0 + 0 + 0) / 3, A_2 = 0 - (1 + 0 + 0) / 3
    assert rloo_advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert rloo_advantages([0.2, 0.8]) == pytest.approx([-0.6, 0.6])
    assert rloo_advantages([0.7]) == [0.0]


def test_dr_grpo_is_the_mean_baseline_without_std():
    cfg = AdvantageConfig(estimator="dr_grpo")
    assert group_advantages([1.0, 0.0, 0.0, 0.0], [5, 5, 5, 5], cfg) == pytest.approx([0.75, -0.25, -0.25, -0.25])
    with pytest.raises(ValueError, match="std_normalize applies to estimator 'grpo' only"):
        AdvantageConfig(estimator="dr_grpo", std_normalize=True)


def test_length_penalty_charges_the_longest_answer_the_full_penalty():
    assert length_penalized([1.0, 1.0, 0.0], [10, 20, 0], 0.5) == pytest.approx([0.75, 0.5, 0.0])
    cfg = AdvantageConfig(length_penalty=0.5)
    # equal rewards, different lengths: the shorter answer is preferred
    assert group_advantages([1.0, 1.0], [10, 20], cfg) == pytest.approx([0.125, -0.125])
    assert group_advantages([1.0, 1.0], [0, 0], cfg) == [0.0, 0.0]


def test_group_with_equal_rewards_carries_no_signal():
    assert not carries_signal(grpo_advantages([0.7, 0.7, 0.7]))
    assert carries_signal(grpo_advantages([0.7, 0.7, 0.8]))


def rollout(reward: float, samples: int = 1, error: str | None = None) -> Rollout:
    tokens = [TokenSample([1, 2, 3], [False, True, True], [0.0, -0.1, -0.2]) for _ in range(samples)]
    return Rollout(Example([], ""), tokens, [], [0], "", "stop", reward=reward, error=error)


def test_each_environment_uses_its_own_estimator_and_silent_groups_are_left_out():
    cfg = OrchestratorConfig(
        batch_size=4, group_size=2, environments={"a": {"advantage": {"estimator": "rloo"}}, "b": {}}
    )
    groups = [
        ("a", [rollout(1.0), rollout(0.0, samples=2)]),  # rloo: +1, -1; the second has a prefix break
        ("b", [rollout(1.0), rollout(0.0)]),  # grpo: +0.5, -0.5
        ("b", [rollout(0.5), rollout(0.5)]),  # no signal
        ("b", [rollout(1.0), rollout(0.0, error="boom"), rollout(0.0)]),  # the errored one is left out
    ]
    scored = [score_group(GroupTicket(i, label, Example([], ""), 0), g, cfg) for i, (label, g) in enumerate(groups)]
    samples = Batch(1, scored, dropped=0).samples(temperature=1.0)
    assert [s.advantage for s in samples] == pytest.approx([1.0, -1.0, -1.0, 0.5, -0.5, 0.5, -0.5])
    assert sum(not g.carries_signal for g in scored) == 1


def test_environments_are_configured_by_label():
    cfg, _ = load(OrchestratorConfig, ["--environments.easy.name", "arithmetic", "--environments.easy.weight", "3"])
    assert list(cfg.environments) == ["easy"] and cfg.environments["easy"].weight == 3
    assert OrchestratorConfig().environments["reverse_text"].name is None  # the label is the name
    with pytest.raises(ConfigError, match="std_normalize applies to estimator 'grpo' only"):
        load(
            OrchestratorConfig,
            ["--environments.x.advantage.estimator", "rloo", "--environments.x.advantage.std-normalize"],
        )


@pytest.mark.parametrize(
    ("step", "level", "oldest"),
    [(1, 0, 0), (2, 0, 1), (5, 0, 4), (1, 1, 0), (2, 1, 0), (3, 1, 1), (10, 2, 7)],
)
def test_off_policy_bound(step, level, oldest):
    assert min_policy_version(step, level) == oldest
