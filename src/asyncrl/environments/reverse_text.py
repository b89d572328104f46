"""reverse_text: reverse a random lowercase string character by character.

Data is generated locally from a seed. The reward is difflib's similarity ratio between the answer and
the reversed text, so partly right answers earn partial credit and RL has a gradient to climb.
"""

from __future__ import annotations

import difflib
import random
import string
from collections.abc import Iterator

from asyncrl.environments.base import Environment, Example
from asyncrl.environments.rubric import Rubric

SYSTEM_PROMPT = "Reverse the text character by character. Answer with the reversed text only."


class ReverseText(Environment):
    name = "reverse_text"

    def __init__(self, min_length: int = 8, max_length: int = 24, alphabet: str = string.ascii_lowercase):
        if not 1 <= min_length <= max_length:
            raise ValueError(f"need 1 <= min_length <= max_length, got {min_length} and {max_length}")
        self.min_length = min_length
        self.max_length = max_length
        self.alphabet = alphabet
        self.rubric = Rubric(rewards=[(similarity, 1.0)], metrics=[exact_match])

    def examples(self, seed: int) -> Iterator[Example]:
        rng = random.Random(seed)
        while True:
            length = rng.randint(self.min_length, self.max_length)
            text = "".join(rng.choice(self.alphabet) for _ in range(length))
            yield Example(
                prompt=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}],
                answer=text[::-1],
            )


def similarity(completion: str, example: Example) -> float:
    return difflib.SequenceMatcher(None, completion.strip(), example.answer).ratio()


def exact_match(completion: str, example: Example) -> float:
    return float(completion.strip() == example.answer)
