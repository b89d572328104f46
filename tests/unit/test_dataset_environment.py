"""The `dataset` environment: rows of a file become examples, scored by a reward given by import path; epochs are
seeded orders; a finite stream ends an RL run with a message naming the environment."""

from __future__ import annotations

import asyncio
import json
from itertools import islice

import datasets
import pytest
from scripted_policy import ScriptedPolicy  # tests/unit, on sys.path under pytest

from asyncrl.environments import load_environment
from asyncrl.errors import AsyncRLError
from asyncrl.orchestrator.sampler import EnvironmentSampler

ROWS = [{"question": f"{i} + {i}", "answer": str(2 * i), "level": i % 3} for i in range(6)]


def contains_answer(completion, example):  # a reward given by import path: test_dataset_environment:...
    return float(example.answer in completion)


@pytest.fixture()
def jsonl(tmp_path):
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return str(path)


def sums(path, **args):
    return load_environment("dataset", path=path, prompt_column="question", **args)


def test_rows_become_examples_with_the_other_columns_as_info(jsonl):
    env = sums(jsonl, system_prompt="Add.", shuffle=False)
    example = next(env.examples(seed=0))
    assert example.prompt == [{"role": "system", "content": "Add."}, {"role": "user", "content": "0 + 0"}]
    assert example.answer == "0" and example.info == {"level": 0}


def test_each_epoch_is_every_row_once_in_a_seeded_order(jsonl):
    env = sums(jsonl, epochs=2)
    drawn = [e.answer for e in env.examples(seed=3)]
    assert drawn == [e.answer for e in env.examples(seed=3)]
    assert sorted(drawn[:6]) == sorted(drawn[6:]) == sorted(r["answer"] for r in ROWS) and len(drawn) == 12
    assert drawn[:6] != drawn[6:]
    endless = sums(jsonl)
    assert len(list(islice(endless.examples(seed=3), 50))) == 50


def test_the_reward_function_is_given_by_import_path(jsonl):
    env = sums(jsonl, reward="test_dataset_environment:contains_answer")
    [rollout] = asyncio.run(env.rollout_group(next(env.examples(0)), ScriptedPolicy(["it is 4 or 0"]), 1))
    exact = sums(jsonl)
    example = next(exact.examples(0))
    [right] = asyncio.run(exact.rollout_group(example, ScriptedPolicy([f" {example.answer} "]), 1))
    assert rollout.metrics == {"contains_answer": float(example.answer in "it is 4 or 0")}
    assert right.reward == 1.0 and right.metrics == {"exact_match": 1.0}
    with pytest.raises(AsyncRLError, match="reward 'nowhere:nothing' could not be imported"):
        sums(jsonl, reward="nowhere:nothing")
    with pytest.raises(AsyncRLError, match="not \\['missing'\\]"):
        load_environment("dataset", path=jsonl, prompt_column="question", answer_column="missing")


def test_evals_read_the_eval_split_or_the_held_out_rows(jsonl, tmp_path):
    held = sums(jsonl, held_out=2, epochs=1)
    assert [e.answer for e in held.eval_examples()] == ["8", "10"]
    assert sorted(e.answer for e in held.examples(0)) == ["0", "2", "4", "6"]
    train, test = datasets.Dataset.from_list(ROWS[:4]), datasets.Dataset.from_list(ROWS[4:])
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "folder"))
    split = sums(str(tmp_path / "folder"), eval_split="test")
    assert [e.answer for e in split.eval_examples()] == ["8", "10"]


def test_a_finite_stream_ends_an_rl_run_with_a_message_naming_the_environment(jsonl):
    sampler = EnvironmentSampler({"sums": sums(jsonl, epochs=1)}, {"sums": 1.0}, seed=0)

    async def draw_batches():  # as the orchestrator does: in a coroutine, where StopIteration is not allowed
        for _ in range(4):
            sampler.draw(2)

    with pytest.raises(AsyncRLError, match="environment 'sums' ran out of examples after 6"):
        asyncio.run(draw_batches())
