import pytest

from asyncrl.orchestrator.advantages import carries_signal, grpo_advantages
from asyncrl.orchestrator.loop import min_policy_version


def test_grpo_advantage_is_reward_minus_group_mean():
    assert grpo_advantages([1.0, 0.0, 0.5, 0.5]) == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_std_normalised_advantages_have_unit_spread():
    advantages = grpo_advantages([1.0, 0.0, 1.0, 0.0], std_normalize=True)
    assert advantages == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)


def test_group_with_equal_rewards_carries_no_signal():
    assert not carries_signal(grpo_advantages([0.7, 0.7, 0.7]))
    assert carries_signal(grpo_advantages([0.7, 0.7, 0.8]))


@pytest.mark.parametrize(
    ("step", "level", "oldest"),
    [(1, 0, 0), (2, 0, 1), (5, 0, 4), (1, 1, 0), (2, 1, 0), (3, 1, 1), (10, 2, 7)],
)
def test_off_policy_bound(step, level, oldest):
    assert min_policy_version(step, level) == oldest
