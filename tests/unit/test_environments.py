import asyncio
import math

import pytest

from asyncrl.environments import load_environment
from asyncrl.environments.base import Example
from asyncrl.environments.rubric import Rubric
from asyncrl.errors import AsyncRLError


def test_reverse_text_examples_are_seeded_and_within_lengths():
    env = load_environment("reverse_text", min_length=3, max_length=5)
    a = [e for _, e in zip(range(20), env.examples(seed=1))]
    b = [e for _, e in zip(range(20), env.examples(seed=1))]
    assert [e.answer for e in a] == [e.answer for e in b]
    assert all(3 <= len(e.answer) <= 5 for e in a)
    assert all(e.answer == e.prompt[-1]["content"][::-1] for e in a)


def test_reverse_text_reward_is_similarity_to_the_reversed_text():
    env = load_environment("reverse_text")
    example = Example(prompt=[], answer="dcba")
    assert asyncio.run(env.rubric.score("dcba", example)).reward == 1.0
    assert asyncio.run(env.rubric.score("dcxx", example)).reward == pytest.approx(0.5)
    assert asyncio.run(env.rubric.score("", example)).reward == 0.0


def test_unknown_environment_is_a_clear_error():
    with pytest.raises(AsyncRLError, match="unknown environment 'nope'"):
        load_environment("nope")


def test_reward_function_that_raises_or_returns_nan_marks_the_rollout_errored():
    def boom(completion, example):
        raise RuntimeError("bad")

    def nan(completion, example):
        return math.nan

    example = Example(prompt=[], answer="x")
    assert "RuntimeError: bad" in asyncio.run(Rubric([(boom, 1.0)]).score("x", example)).error
    assert "NaN" in asyncio.run(Rubric([(nan, 1.0)]).score("x", example)).error


def test_slow_reward_function_times_out():
    async def slow(completion, example):
        await asyncio.sleep(5)
        return 1.0

    score = asyncio.run(Rubric([(slow, 1.0)], timeout=0.05).score("x", Example(prompt=[], answer="x")))
    assert score.error and "timed out" in score.error


def test_weighted_rewards_and_unweighted_metrics():
    def a(completion, example):
        return 1.0

    async def b(completion, example):
        return 0.5

    def length(completion, example):
        return len(completion)

    score = asyncio.run(Rubric([(a, 0.5), (b, 2.0)], metrics=[length]).score("abc", Example(prompt=[], answer="")))
    assert score.reward == pytest.approx(1.5)
    assert score.metrics == {"a": 1.0, "b": 0.5, "length": 3.0}


def test_environment_by_import_path():
    env = load_environment("asyncrl.environments.reverse_text:ReverseText", min_length=2, max_length=2)
    assert len(next(env.examples(0)).answer) == 2
    with pytest.raises(AsyncRLError, match="could not be imported"):
        load_environment("no_such_module:Env")
