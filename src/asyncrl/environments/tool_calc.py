"""tool_calc: compute a product of large numbers with a calculator tool, then answer.

A tool-use task. The calculator is described to the model through the chat template (`tools=`, as
OpenAI-style JSON schemas); the model calls it by writing
`<tool_call>{"name": "calculator", "arguments": {"expression": "4821 * 37"}}</tool_call>` in its message,
the environment runs the call and answers with a `tool` message holding the result (or the error), and
the episode ends with the first assistant message that calls no tool. Numbers are big enough that
guessing rarely works. Each example's `demonstration` (for SFT) is the whole episode: the call, its result, the
answer. Rewards:
- `correct` (weight 1): the integer in the last `<answer>` tag is the exact value;
- `called_calculator` (weight `tool_weight`, 0.2): at least one tool call ran without error.
Metrics: `tool_calls`, `tool_errors`.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Iterator

from asyncrl.environments.base import Environment, Example, Messages, State
from asyncrl.environments.rubric import Rubric

# Kept short, with no example numbers: a description holding an example expression ("4821 * 37 + 199") gave
# the small model a second string of digits to copy from, and its SFT never learned to copy the question's
# (loss stuck at 0.35 after 750 steps; without the example the copying came at step ~500; examples/tool_calc).
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_EXPONENT = 64  # keeps `9 ** 9 ** 9` from running the environment out of time and memory


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression, without `eval`: only numbers and the OPERATORS are allowed."""

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
            return OPERATORS[type(node.op)](left, right)
        raise ValueError(f"unsupported expression element: {ast.dump(node)[:60]}")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    result = value(tree.body)
    return int(result) if isinstance(result, float) and result.is_integer() else result


def run_tool_call(text: str) -> str:
    """The result of one `<tool_call>` body, or the error the model should read."""
    try:
        call = json.loads(text)
        if not isinstance(call, dict) or call.get("name") != "calculator":
            raise ValueError('call the tool as {"name": "calculator", "arguments": {"expression": "..."}}')
        arguments = call.get("arguments")
        if not isinstance(arguments, dict) or not isinstance(arguments.get("expression"), str):
            raise ValueError('arguments must be {"expression": "<arithmetic>"}')
        return str(calculate(arguments["expression"]))
    except (ValueError, ArithmeticError, RecursionError) as e:  # JSONDecodeError is a ValueError
        return f"error: {e}"


class ToolCalc(Environment):
    name = "tool_calc"
    tools = [CALCULATOR]

    def __init__(self, min_digits: int = 3, max_digits: int = 5, tool_weight: float = 0.2, **limits):
        super().__init__(**{"max_turns": 4, **limits})
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits} and {max_digits}")
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.rubric = Rubric(
            rewards=[(correct, 1.0), (called_calculator, tool_weight)], metrics=[tool_calls, tool_errors]
        )

    def examples(self, seed: int) -> Iterator[Example]:
        rng = random.Random(seed)

        def number() -> int:
            digits = rng.randint(self.min_digits, self.max_digits)
            return rng.randint(10 ** (digits - 1), 10**digits - 1)

        while True:
            a, b, c = number(), number(), number()
            expression = f"{a} * {b} + {c}"
            value = a * b + c
            question = f"What is {expression}? Use the calculator, then reply with <answer>the number</answer>."
            call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
            yield Example(
                prompt=[{"role": "user", "content": question}],
                answer=f"<answer>{value}</answer>",
                info={"value": value, "expression": expression},
                demonstration=[
                    {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                    {"role": "tool", "content": str(value)},
                    {"role": "assistant", "content": f"<answer>{value}</answer>"},
                ],
            )

    async def respond(self, messages: Messages, state: State, example: Example) -> Messages | None:
        calls = TOOL_CALL.findall(messages[-1]["content"])
        if not calls:
            return None
        results = [run_tool_call(call.strip()) for call in calls]
        state["tool_calls"] = state.get("tool_calls", 0) + len(results)
        state["tool_errors"] = state.get("tool_errors", 0) + sum(r.startswith("error:") for r in results)
        return [{"role": "tool", "content": result} for result in results]


def correct(completion: str, example: Example) -> float:
    answers = ANSWER.findall(completion)
    return float(bool(answers) and int(answers[-1]) == example.info["value"])


def called_calculator(completion: str, example: Example, state: State) -> float:
    return float(state.get("tool_calls", 0) > state.get("tool_errors", 0))


def tool_calls(completion: str, example: Example, state: State) -> float:
    return state.get("tool_calls", 0)


def tool_errors(completion: str, example: Example, state: State) -> float:
    return state.get("tool_errors", 0)
