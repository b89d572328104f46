"""arithmetic: evaluate a multi-step integer expression such as `((7 + 5) * 3) - 4`.

Data is generated locally from a seed; operations apply left to right (the parentheses say so). The
reference answer works the expression out one operation per line and ends with `<answer>32</answer>`,
so SFT teaches both the steps and the format. Rewards:
- `correct` (weight 1): the integer in the last `<answer>` tag is the value of the expression;
- `formatted` (weight `format_weight`, 0.2): the completion ends with exactly one `<answer>integer</answer>`.

Like reverse_text, the prompt is the expression alone unless `system_prompt` is given (tiny models learn
faster from short prompts).
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Iterator

from asyncrl.environments.base import Environment, Example
from asyncrl.environments.rubric import Rubric

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
FORMATTED = re.compile(r"(?s)(?:(?!<answer>).)*<answer>-?\d+</answer>\s*")


class Arithmetic(Environment):
    name = "arithmetic"

    def __init__(
        self,
        min_operations: int = 1,
        max_operations: int = 3,
        max_operand: int = 20,
        format_weight: float = 0.2,
        system_prompt: str | None = None,
        **limits,
    ):
        super().__init__(**limits)
        if not 1 <= min_operations <= max_operations:
            raise ValueError(f"need 1 <= min_operations <= max_operations, got {min_operations} and {max_operations}")
        if max_operand < 1:
            raise ValueError(f"max_operand must be at least 1, got {max_operand}")
        self.min_operations = min_operations
        self.max_operations = max_operations
        self.max_operand = max_operand
        self.system_prompt = system_prompt
        self.rubric = Rubric(rewards=[(correct, 1.0), (formatted, format_weight)])

    def examples(self, seed: int) -> Iterator[Example]:
        rng = random.Random(seed)
        while True:
            value = rng.randint(1, self.max_operand)
            expression, steps = str(value), []
            for i in range(rng.randint(self.min_operations, self.max_operations)):
                symbol, operand = rng.choice(list(OPERATIONS)), rng.randint(1, self.max_operand)
                result = OPERATIONS[symbol](value, operand)
                steps.append(f"{value} {symbol} {operand} = {result}")
                expression = f"({expression}) {symbol} {operand}" if i else f"{expression} {symbol} {operand}"
                value = result
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            yield Example(
                prompt=[*system, {"role": "user", "content": expression}],
                answer="\n".join([*steps, f"<answer>{value}</answer>"]),
                info={"value": value},
            )


def correct(completion: str, example: Example) -> float:
    answers = ANSWER.findall(completion)
    return float(bool(answers) and int(answers[-1]) == example.info["value"])


def formatted(completion: str, example: Example) -> float:
    return float(FORMATTED.fullmatch(completion) is not None)
