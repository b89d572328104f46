import asyncio
import json
import math
from pathlib import Path

import pytest
from scripted_policy import ScriptedPolicy  # tests/unit, on sys.path under pytest

from asyncrl.environments import load_environment
from asyncrl.environments.base import Example
from asyncrl.environments.rubric import Rubric
from asyncrl.environments.tool_calc import calculate, run_tool_call
from asyncrl.environments.wordle import marks
from asyncrl.errors import AsyncRLError
from asyncrl.models.offline import build_tokenizer


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


# ---- multi-turn rollouts, token-in/token-out (a scripted policy stands in for the server) ----


def play(env, example, answers, **policy_args):
    policy = ScriptedPolicy(answers, **policy_args)
    [rollout] = asyncio.run(env.rollout_group(example, policy, 1))
    return rollout, policy


WORDLE = Example(prompt=[{"role": "user", "content": "go"}], answer="hello", info={"secret": "hello", "max_guesses": 6})


def test_wordle_marks_match_wordle_with_repeated_letters():
    assert marks("paper", "apple") == "YYGY."
    assert marks("llama", "hello") == "YY..."
    assert marks("lolly", "hello") == ".YGG."
    assert marks("hello", "hello") == "GGGGG"


def test_wordle_rewards_solving_and_fewer_guesses():
    rollout, _ = play(load_environment("wordle"), WORDLE, ["world", "12", "hello"])
    assert rollout.turns == 3 and not rollout.is_truncated and rollout.error is None
    assert [m["content"] for m in rollout.messages[2::2]] == [".Y.G. (5 left)", "not a five-letter word (4 left)"]
    assert rollout.metrics == {"solved": 1.0, "speed": 0.6, "guesses": 3.0, "invalid_guesses": 1.0, "best_greens": 1.0}
    assert rollout.reward == pytest.approx(1.0 + 0.5 * (6 - 3) / 5)
    first_guess_win, _ = play(load_environment("wordle"), WORDLE, ["hello"])
    assert first_guess_win.reward == pytest.approx(1.5)


def test_wordle_demonstrations_replay_as_the_environment_plays_them():
    env = load_environment("wordle", num_words=40)
    examples = [e for _, e in zip(range(20), env.examples(seed=0))]
    assert {e.answer for e in examples} <= set(env.words) and len(env.words) == 40
    for example in examples:
        guesses = [m["content"] for m in example.demonstration if m["role"] == "assistant"]
        for i, guess in enumerate(guesses):  # each guess agrees with every mark before it
            assert all(marks(earlier, guess) == marks(earlier, example.answer) for earlier in guesses[:i])
        rollout, _ = play(env, example, guesses)
        assert rollout.messages[1:] == example.demonstration  # the same marks, in the same words
        assert rollout.metrics["solved"] == (guesses[-1] == example.answer)
        assert example.sft_messages() == example.prompt + example.demonstration
    assert sum(e.demonstration[-1]["content"] == e.answer for e in examples) >= 18
    with pytest.raises(AsyncRLError, match="num_words must be between 2 and"):
        load_environment("wordle", num_words=1)


def test_wordle_unsolved_game_ends_after_max_guesses_with_no_reward():
    rollout, _ = play(load_environment("wordle", max_guesses=3), WORDLE, ["world", "lolly", "llama"])
    assert rollout.turns == 3 and not rollout.is_truncated
    assert rollout.reward == 0.0 and rollout.metrics["best_greens"] == pytest.approx(0.4)


def test_each_turn_prompt_extends_the_previous_tokens_and_only_sampled_tokens_are_in_the_loss():
    rollout, policy = play(load_environment("wordle"), WORDLE, ["world", "lolly", "hello"])
    tokenizer = policy.tokenizer
    for prompt, sampled, following in zip(policy.prompts, policy.sampled, policy.prompts[1:]):
        assert following[: len(prompt) + len(sampled)] == prompt + sampled
        environment = tokenizer.decode(following[len(prompt) + len(sampled) :])
        assert environment.startswith("\n<|im_start|>user\n") and environment.endswith("<|im_start|>assistant\n")
    [sample] = rollout.samples
    assert sample.input_ids == policy.prompts[-1] + policy.sampled[-1]
    assert [t for t, m in zip(sample.input_ids, sample.loss_mask) if m] == [t for s in policy.sampled for t in s]
    assert sample.inference_logprobs == [-0.5 if m else 0.0 for m in sample.loss_mask]
    # Same tokens as the chat template gives the whole conversation: nothing was lost or added.
    assert sample.input_ids == tokenizer.apply_chat_template(rollout.messages, tokenize=True, return_dict=False)[:-1]


def test_a_turn_cut_at_max_tokens_gets_its_end_of_turn_outside_the_loss():
    rollout, policy = play(load_environment("wordle", max_guesses=2), WORDLE, ["worlds", "hello"], max_tokens=5)
    end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    first, second = policy.prompts
    cut = len(first) + 5
    assert policy.sampled[0] == policy.tokenizer.encode("world")
    assert second[cut] == end and rollout.samples[0].loss_mask[cut] is False


PREFIX_BREAKING_TEMPLATE = (  # like templates that drop earlier turns' reasoning: the last answer only in full
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}...{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_turn_whose_template_rendering_breaks_the_prefix_starts_a_new_sample():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = PREFIX_BREAKING_TEMPLATE
    rollout, policy = play(load_environment("wordle"), WORDLE, ["world", "hello"], tokenizer=tokenizer)
    assert rollout.prefix_breaks == 1 and rollout.turns == 2 and rollout.reward > 1
    first, second = rollout.samples
    assert first.input_ids == policy.prompts[0] + policy.sampled[0]
    assert second.input_ids == policy.prompts[1] + policy.sampled[1]
    assert "..." in tokenizer.decode(policy.prompts[1])
    assert sum(second.loss_mask) == len(policy.sampled[1])


def test_turn_and_token_limits_truncate_and_keep_the_rollout():
    rollout, _ = play(load_environment("wordle", max_turns=2), WORDLE, ["world", "lolly"])
    assert rollout.turns == 2 and rollout.is_truncated and rollout.error is None
    assert rollout.metrics["guesses"] == 2
    rollout, _ = play(load_environment("wordle", max_tokens=40), WORDLE, ["world", "lolly", "hello"])
    assert rollout.is_truncated and all(len(s.input_ids) <= 40 for s in rollout.samples)


def test_failing_environment_or_reward_in_a_multi_turn_episode_marks_the_rollout_errored():
    class Broken(load_environment("wordle").__class__):
        async def respond(self, messages, state, example):
            raise KeyError("board")

    rollout, _ = play(Broken(), WORDLE, ["world"])
    assert rollout.error == "respond KeyError: 'board'"

    env = load_environment("wordle")
    env.rubric = Rubric([(lambda completion, example, state: state["missing"], 1.0)])
    rollout, _ = play(env, WORDLE, ["hello"])
    assert "KeyError" in rollout.error and rollout.turns == 1


# ---- arithmetic ----


def test_arithmetic_examples_are_seeded_and_their_answer_is_the_value():
    env = load_environment("arithmetic", max_operations=4)
    a = [e for _, e in zip(range(30), env.examples(seed=3))]
    assert [e.prompt for e in a] == [e.prompt for _, e in zip(range(30), env.examples(seed=3))]
    for example in a:
        assert eval(example.prompt[-1]["content"]) == example.info["value"]  # parenthesised left to right
        assert example.answer.endswith(f"<answer>{example.info['value']}</answer>")
        assert asyncio.run(env.rubric.score(example.answer, example)).reward == pytest.approx(1.2)


@pytest.mark.parametrize(
    ("completion", "correct", "formatted"),
    [
        ("<answer>7</answer>", 1, 1),
        ("13 - 12 = 1\n1 * 7 = 7\n<answer>7</answer>\n", 1, 1),
        ("<answer>8</answer>", 0, 1),
        ("7", 0, 0),
        ("<answer>7</answer> so 7", 1, 0),
        ("<answer>3</answer><answer>7</answer>", 1, 0),
        ("<answer>seven</answer>", 0, 0),
    ],
)
def test_arithmetic_rewards_exact_match_and_format(completion, correct, formatted):
    example = Example(prompt=[], answer="", info={"value": 7})
    score = asyncio.run(load_environment("arithmetic").rubric.score(completion, example))
    assert score.metrics == {"correct": correct, "formatted": formatted}
    assert score.reward == pytest.approx(correct + 0.2 * formatted)


# ---- tool_calc ----


def test_calculator_evaluates_arithmetic_and_refuses_anything_else():
    assert calculate("4821 * 37 + 199") == 178576
    assert calculate("(7 - 10) // 2") == -2 and calculate("6 / 4") == 1.5 and calculate("6 / 3") == 2
    for bad in ("__import__('os')", "x + 1", "9 ** 999", "1 +"):
        with pytest.raises(ValueError):
            calculate(bad)
    assert run_tool_call('{"name": "calculator", "arguments": {"expression": "2 * 21"}}') == "42"
    assert run_tool_call("not json").startswith("error:")
    assert run_tool_call('{"name": "search", "arguments": {}}').startswith("error:")
    assert run_tool_call('{"name": "calculator", "arguments": {"expression": "1 / 0"}}').startswith("error:")


def test_tool_calc_runs_the_tool_call_and_rewards_the_answer():
    env = load_environment("tool_calc")
    example = next(env.examples(seed=0))
    expression, value = example.info["expression"], example.info["value"]
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    answers = [f"<tool_call>{call}</tool_call>", f"<answer>{value}</answer>"]
    rollout, policy = play(env, example, answers, max_tokens=200)
    assert [m["role"] for m in rollout.messages] == ["user", "assistant", "tool", "assistant"]
    assert rollout.messages[2]["content"] == str(value)
    assert rollout.turns == 2 and rollout.reward == pytest.approx(1.2)
    assert rollout.metrics["tool_calls"] == 1 and rollout.metrics["tool_errors"] == 0
    assert '"name": "calculator"' in policy.tokenizer.decode(policy.prompts[0])  # the template lists the tool
    assert "<|im_start|>tool\n" in policy.tokenizer.decode(policy.prompts[1])

    guessed, _ = play(env, example, [f"<answer>{value}</answer>"])
    assert guessed.turns == 1 and guessed.reward == pytest.approx(1.0)
    failed, _ = play(env, example, ["<tool_call>{oops}</tool_call>", "<answer>1</answer>"])
    assert failed.metrics["tool_errors"] == 1 and failed.reward == 0.0


def test_tool_calc_demonstration_is_an_episode_that_earns_the_full_reward():
    env = load_environment("tool_calc")
    example = next(env.examples(seed=1))
    assert [m["role"] for m in example.demonstration] == ["assistant", "tool", "assistant"]
    answers = [m["content"] for m in example.demonstration if m["role"] == "assistant"]
    rollout, _ = play(env, example, answers, max_tokens=200)
    assert rollout.messages[1:] == example.demonstration and rollout.reward == pytest.approx(1.2)


def test_every_builtin_environment_loads_by_name():
    for name in ("reverse_text", "arithmetic", "wordle", "tool_calc"):
        assert load_environment(name).name == name
    with pytest.raises(AsyncRLError, match="max_operations"):
        load_environment("arithmetic", min_operations=3, max_operations=1)


def test_the_example_in_docs_environments_md_plays_as_documented():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()
    namespace: dict = {}
    exec(docs.split("```python\n")[1].split("```")[0], namespace)

    countdown = namespace["Countdown"](start=3)
    example = next(countdown.examples(seed=0))
    rollout, _ = play(countdown, example, [example.answer])
    assert rollout.reward == 1.0 and rollout.metrics == {"exact": 1.0, "length": len(example.answer)}

    guess = namespace["GuessNumber"]()
    example = next(guess.examples(seed=0))
    secret = example.info["secret"]
    rollout, _ = play(guess, example, ["fifty", str(secret + 1), str(secret)])
    assert rollout.turns == 3 and rollout.reward == 1.0
    assert [m["content"] for m in rollout.messages[2::2]] == ["Answer with a number.", "lower"]

    unit = namespace["Unit"]()
    example = next(unit.examples(seed=0))
    inches = float(example.prompt[0]["content"].split()[4])
    call = json.dumps({"name": "convert", "arguments": {"inches": inches}})
    rollout, _ = play(unit, example, [f"<tool_call>{call}</tool_call>", example.answer], max_tokens=100)
    assert rollout.messages[2] == {"role": "tool", "content": example.answer}
    assert rollout.reward == 1.0


# ---- the episode loop: what respond and reward functions are told ----


def test_respond_is_told_the_turn_and_rewards_see_truncation_by_parameter_name():
    seen_turns = []

    def cut(is_truncated: bool, turns: int) -> float:
        return float(is_truncated) + turns / 10

    class Counting(load_environment("wordle").__class__):
        async def respond(self, messages, state, example, turn):
            seen_turns.append(turn)
            return await super().respond(messages, state, example)

    env = Counting(max_guesses=3)
    env.rubric = Rubric([(cut, 1.0)])
    rollout, _ = play(env, WORDLE, ["world", "lolly", "llama"])
    assert seen_turns == [1, 2, 3]
    assert rollout.is_truncated is False and rollout.reward == pytest.approx(0.3)  # the game ended itself

    env = Counting(max_guesses=3, max_turns=2)
    env.rubric = Rubric([(cut, 1.0)])
    rollout, _ = play(env, WORDLE, ["world", "lolly"])
    assert rollout.is_truncated and rollout.reward == pytest.approx(1.2)  # max_turns ended it


def test_reward_function_with_an_unknown_parameter_is_refused_when_the_rubric_is_built():
    def judge(completion, reference):
        return 1.0

    with pytest.raises(ValueError, match="'judge' takes 'reference'; reward functions take any of completion"):
        Rubric([(judge, 1.0)])


def test_a_rollout_that_ends_on_an_environment_message_is_scored_on_the_last_answer():
    class SlowSecondAnswer(ScriptedPolicy):
        async def generate(self, prompt_ids, n, max_tokens=None):
            if self.prompts:
                await asyncio.sleep(5)
            return await super().generate(prompt_ids, n, max_tokens)

    env = load_environment("wordle", time_limit=0.5)  # the second answer comes too late
    env.rubric = Rubric([(lambda completion: float(completion == "world"), 1.0)])
    [rollout] = asyncio.run(env.rollout_group(WORDLE, SlowSecondAnswer(["world", "lolly"]), 1))
    assert rollout.messages[-1]["role"] == "user" and rollout.is_truncated
    assert rollout.completion_text == "world" and rollout.reward == 1.0
