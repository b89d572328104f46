import itertools

from asyncrl.environments import load_environment
from asyncrl.orchestrator.sampler import EnvironmentSampler


def sampler(weights=None) -> EnvironmentSampler:
    environments = {"reverse": load_environment("reverse_text"), "arith": load_environment("arithmetic")}
    return EnvironmentSampler(environments, weights or {"reverse": 3.0, "arith": 1.0}, seed=5)


def test_batches_follow_the_weights_to_within_one_group():
    s = sampler()
    for _ in range(5):
        labels = [label for label, _ in s.draw(8)]
        assert labels.count("reverse") == 6 and labels.count("arith") == 2
    uneven = sampler({"reverse": 1.0, "arith": 2.0})
    labels = [label for label, _ in uneven.draw(3)]
    assert sorted(labels) == ["arith", "arith", "reverse"]


def test_each_environment_draws_from_its_own_seeded_stream():
    s = sampler()
    drawn = s.draw(12)
    reverse_stream = load_environment("reverse_text").examples(5)
    expected = list(itertools.islice(reverse_stream, 9))
    assert [e.answer for label, e in drawn if label == "reverse"] == [e.answer for e in expected]


def test_a_restored_sampler_draws_what_the_saved_one_would_have():
    saved = sampler()
    saved.draw(7)
    state = saved.state_dict()
    assert state == {"drawn": {"reverse": 5, "arith": 2}}
    restored = sampler()
    restored.load_state_dict(state)
    assert [(label, e.prompt) for label, e in restored.draw(9)] == [(label, e.prompt) for label, e in saved.draw(9)]
