"""dataset: prompts and reference answers from a file or a Hugging Face dataset, scored by your reward function.

Each row is one example: the `prompt_column` (a string, or a list of chat messages) is the prompt, the
`answer_column` the reference answer, and every other column goes into `Example.info`. The reward function is
given by import path (`reward = "my_rewards:exact"`) and takes any of the rubric's arguments by name
(`completion`, `example`, ...); the default, `exact_match`, is 1 when the answer's stripped text equals the
reference. Training draws the rows in a new seeded order every epoch; `epochs` bounds how many (unset:
as many as the run needs). Evals read `eval_split`, or else the last `held_out` rows (kept out of training),
or else the training rows in file order.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

from asyncrl.data import as_messages, epoch_order, load_rows
from asyncrl.environments.base import Environment, Example
from asyncrl.environments.rubric import Rubric
from asyncrl.errors import AsyncRLError


def exact_match(completion: str, example: Example) -> float:
    return float(completion.strip() == example.answer.strip())


def import_function(path: str, what: str) -> Callable:
    module_name, _, attr = path.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise AsyncRLError(f"{what} '{path}' could not be imported ({e}); give it as 'module:function'") from None
    if not callable(function):
        raise AsyncRLError(f"{what} '{path}' is not a function")
    return function


class Dataset(Environment):
    name = "dataset"

    def __init__(
        self,
        path: str | list[str],
        split: str = "train",
        subset: str | None = None,
        prompt_column: str = "prompt",
        answer_column: str = "answer",
        system_prompt: str | None = None,
        reward: str = "asyncrl.environments.dataset:exact_match",
        metrics: list[str] = (),
        epochs: int | None = None,
        shuffle: bool = True,
        eval_split: str | None = None,
        held_out: int = 0,
        **limits,
    ):
        super().__init__(**limits)
        self.rows = load_rows(path, split, subset)
        missing = {prompt_column, answer_column} - set(self.rows.column_names)
        if missing:
            raise AsyncRLError(
                f"dataset '{path}' has columns {self.rows.column_names}, not {sorted(missing)} "
                "(set prompt_column and answer_column)"
            )
        if not 0 <= held_out < len(self.rows):
            raise ValueError(f"held_out = {held_out}, but '{path}' has {len(self.rows)} rows")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be at least 1 (or unset: endless), got {epochs}")
        self.path = path
        self.prompt_column = prompt_column
        self.answer_column = answer_column
        self.system_prompt = system_prompt
        self.epochs = epochs
        self.shuffle = shuffle
        self.training_rows = len(self.rows) - held_out
        self.eval_rows = load_rows(path, eval_split, subset) if eval_split else None
        self.held_out = held_out
        self.rubric = Rubric(
            rewards=[(import_function(reward, "reward"), 1.0)],
            metrics=[import_function(metric, "metric") for metric in metrics],
        )

    def example(self, row: dict[str, Any]) -> Example:
        prompt = as_messages(row[self.prompt_column], "user", self.prompt_column)
        if self.system_prompt:
            prompt = [{"role": "system", "content": self.system_prompt}, *prompt]
        info = {key: value for key, value in row.items() if key not in (self.prompt_column, self.answer_column)}
        return Example(prompt=prompt, answer=str(row[self.answer_column]), info=info)

    def examples(self, seed: int) -> Iterator[Example]:
        for index in epoch_order(self.training_rows, seed, self.epochs, self.shuffle):
            yield self.example(self.rows[index])

    def eval_examples(self) -> Iterator[Example]:
        if self.eval_rows is not None:
            return (self.example(row) for row in self.eval_rows)
        first = self.training_rows if self.held_out else 0
        return (self.example(self.rows[i]) for i in range(first, len(self.rows)))
