"""code: write a Python function; hidden tests run it in the sandbox; reward = the fraction of tests passed.

Tasks are generated from the seed (small functions of one argument, e.g. "returns x * 3 + 2", "returns the
number of vowels in s"), each with one example in the prompt, `num_tests` hidden tests on other inputs and a
reference solution as its answer (for SFT); or
read from a file or dataset (`path`) with a `prompt` column and a `tests` column of `assert <call> ==
<literal>` lines (MBPP's form). The answer's code is the last ```python block of the completion, or the whole
completion when it has none. It runs in `sandbox.py` (limits `cpu_seconds`, `memory_mb`, `wall_seconds`):
only the calls go in, the expected values stay out. Rewards:
- `passed` (weight 1): the fraction of hidden tests whose value equals the expected one;
Metrics: `runs` (the code ran without an error at the top level), `killed` (a limit ended it).
Scoring starts a Python process per rollout: run it with `env_server` so it never holds up the orchestrator.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator

from asyncrl.data import as_messages, epoch_order, load_rows
from asyncrl.environments.base import Environment, Example, State
from asyncrl.environments.rubric import Rubric
from asyncrl.environments.sandbox import SandboxLimits, Test, run_tests

CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
WORDS = "apple banana cherry river stone cloud light green music table ocean tiger sugar".split()


def _number_task(rng: random.Random) -> tuple[str, Callable, Callable, str]:
    """A task on a number: its description, the function, an input generator and a reference solution's body."""
    a, b = rng.randint(2, 9), rng.randint(0, 9)
    kind = rng.choice(["affine", "square", "digits", "even"])
    if kind == "affine":
        return f"returns x * {a} + {b}", lambda x: x * a + b, lambda: rng.randint(-20, 20), f"return x * {a} + {b}"
    if kind == "square":
        return f"returns x squared minus {b}", lambda x: x * x - b, lambda: rng.randint(-12, 12), f"return x * x - {b}"
    if kind == "digits":
        return (
            "returns the sum of the decimal digits of x (x >= 0)",
            lambda x: sum(map(int, str(x))),
            (lambda: rng.randint(0, 99999)),
            "return sum(int(d) for d in str(x))",
        )
    return (
        f"returns True when x is divisible by {a}, else False",
        lambda x: x % a == 0,
        lambda: rng.randint(0, 60),
        f"return x % {a} == 0",
    )


def _text_task(rng: random.Random) -> tuple[str, Callable, Callable, str]:
    letter = rng.choice("aeinorst")
    kind = rng.choice(["reverse", "count", "upper", "vowels"])
    word = lambda: rng.choice(WORDS)[: rng.randint(3, 6)]  # noqa: E731 - a tiny input generator
    if kind == "reverse":
        return "returns the string s reversed", lambda s: s[::-1], word, "return x[::-1]"
    if kind == "count":
        return (
            f"returns how many times the letter '{letter}' occurs in s",
            lambda s: s.count(letter),
            word,
            f"return x.count('{letter}')",
        )
    if kind == "upper":
        return "returns s in upper case", lambda s: s.upper(), word, "return x.upper()"
    return (
        "returns the number of vowels (a, e, i, o, u) in s",
        lambda s: sum(c in "aeiou" for c in s),
        word,
        "return sum(c in 'aeiou' for c in x)",
    )


def extract_code(completion: str) -> str:
    blocks = CODE_BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


class Code(Environment):
    name = "code"

    def __init__(
        self,
        num_tests: int = 5,
        path: str | list[str] | None = None,
        split: str = "train",
        prompt_column: str = "prompt",
        tests_column: str = "tests",
        epochs: int | None = None,
        held_out: int = 0,
        cpu_seconds: int = 2,
        memory_mb: int = 512,
        wall_seconds: float = 10.0,
        **limits,
    ):
        super().__init__(**limits)
        if num_tests < 1:
            raise ValueError(f"num_tests must be at least 1, got {num_tests}")
        self.num_tests = num_tests
        self.sandbox = SandboxLimits(cpu_seconds=cpu_seconds, memory_mb=memory_mb, wall_seconds=wall_seconds)
        self.rows = load_rows(path, split) if path is not None else None
        if self.rows is not None and not 0 <= held_out < len(self.rows):
            raise ValueError(f"held_out = {held_out}, but '{path}' has {len(self.rows)} rows")
        self.prompt_column, self.tests_column = prompt_column, tests_column
        self.epochs, self.held_out = epochs, held_out
        self.rubric = Rubric(rewards=[(self.passed, 1.0)], metrics=[runs, killed])

    def _generated(self, rng: random.Random) -> Example:
        description, function, draw, body = rng.choice([_number_task, _text_task])(rng)
        inputs: list = []
        while len(inputs) < self.num_tests + 1:  # distinct inputs: one shown, the rest hidden
            value = draw()
            if value not in inputs:
                inputs.append(value)
        shown, hidden = inputs[0], inputs[1:]
        prompt = (
            f"Write a Python function f(x) that {description}. For example, f({shown!r}) == {function(shown)!r}. "
            "Answer with the code in a ```python block."
        )
        tests = [{"call": f"f({x!r})", "expected": repr(function(x))} for x in hidden]
        solution = f"```python\ndef f(x):\n    {body}\n```"
        return Example(prompt=[{"role": "user", "content": prompt}], answer=solution, info={"tests": tests})

    def _from_row(self, row: dict) -> Example:
        tests = [Test.from_assert(line) for line in row[self.tests_column]]
        info = {"tests": [{"call": t.call, "expected": t.expected} for t in tests]}
        return Example(prompt=as_messages(row[self.prompt_column], "user", self.prompt_column), answer="", info=info)

    def examples(self, seed: int) -> Iterator[Example]:
        if self.rows is None:
            rng = random.Random(seed)
            while True:
                yield self._generated(rng)
        for index in epoch_order(len(self.rows) - self.held_out, seed, self.epochs):
            yield self._from_row(self.rows[index])

    def eval_examples(self) -> Iterator[Example]:
        """Generated tasks: the EVAL_SEED stream. Rows: the `held_out` last ones, or else every row."""
        if self.rows is None:
            return super().eval_examples()
        first = len(self.rows) - self.held_out if self.held_out else 0
        return (self._from_row(self.rows[i]) for i in range(first, len(self.rows)))

    def passed(self, completion: str, example: Example, state: State) -> float:
        tests = [Test(t["call"], t["expected"]) for t in example.info["tests"]]
        result = run_tests(extract_code(completion), tests, self.sandbox)
        state["runs"] = float(result.code_error is None and not result.killed)
        state["killed"] = float(result.killed)
        return result.fraction_passed


def runs(state: State) -> float:
    return state.get("runs", 0.0)


def killed(state: State) -> float:
    return state.get("killed", 0.0)
