"""reverse_text: reverse a random lowercase string character by character.

Data is generated locally from a seed. The reward is difflib's similarity ratio between the answer and
the reversed text, so partly right answers earn partial credit and RL has a gradient to climb.

The prompt is the text alone unless `system_prompt` is given: a tiny model learns the task from SFT, and
every prompt token is one more place its attention must search (measured on 2 CPU cores: with a 16-word
instruction, a 0.8M model stayed at chance for 200 SFT steps on 3-6 letters; without one it learns 4-12
letters in about 250). Give an instruction to models that follow instructions.
"""

from __future__ import annotations

import difflib
import random
import string
from collections.abc import Iterator

from asyncrl.environments.base import Environment, Example
from asyncrl.environments.rubric import Rubric


class ReverseText(Environment):
    name = "reverse_text"

    def __init__(
        self,
        min_length: int = 4,
        max_length: int = 12,
        alphabet: str = string.ascii_lowercase,
        system_prompt: str | None = None,
        **limits,
    ):
        super().__init__(**limits)
        if not 1 <= min_length <= max_length:
            raise ValueError(f"need 1 <= min_length <= max_length, got {min_length} and {max_length}")
        self.min_length = min_length
        self.max_length = max_length
        self.alphabet = alphabet
        self.system_prompt = system_prompt
        self.rubric = Rubric(rewards=[(similarity, 1.0)], metrics=[exact_match])

    def examples(self, seed: int) -> Iterator[Example]:
        rng = random.Random(seed)
        while True:
            length = rng.randint(self.min_length, self.max_length)
            text = "".join(rng.choice(self.alphabet) for _ in range(length))
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            yield Example(prompt=[*system, {"role": "user", "content": text}], answer=text[::-1])


def similarity(completion: str, example: Example) -> float:
    return difflib.SequenceMatcher(None, completion.strip(), example.answer).ratio()


def exact_match(completion: str, example: Example) -> float:
    return float(completion.strip() == example.answer)
