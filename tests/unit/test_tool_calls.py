"""Tool calls read from an assistant's text, whole or streamed, in our template's format and Qwen's (Hermes)."""

from __future__ import annotations

import json

import pytest

from asyncrl.inference.api.tool_calls import ToolCallFormat, ToolCallParser, split_tool_calls
from asyncrl.models.offline import build_tokenizer

NAMES = frozenset({"get_weather", "add"})
OURS = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
HERMES = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'

# A Qwen-style (Hermes) template, written for these tests: tools in a system message, each call of an
# assistant message on its own lines inside <tool_call> tags, tool results as user turns.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\nReturn each call as <tool_call>\n{...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def streamed(text: str, piece: int, names: frozenset[str] = NAMES) -> tuple[str, list]:
    parser = ToolCallParser(names)
    content, calls = "", []
    for start in range(0, len(text), piece):
        new_content, new_calls = parser.feed(text[start : start + piece])
        content += new_content
        calls += new_calls
    return content + parser.finish(), calls


def named(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def test_our_format_and_qwen_s_are_read_alike():
    assert split_tool_calls(OURS, NAMES)[1][0].name == "get_weather"
    content, calls = split_tool_calls(f"Let me add.\n{HERMES}\n{OURS}", NAMES)
    assert content == "Let me add.\n\n"
    assert named(calls) == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Paris"})]
    assert calls[0].arguments == '{"a": 1, "b": 2}'  # a JSON object, as text
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_a_text_without_calls_is_all_content():
    assert split_tool_calls("  plain answer\n", NAMES) == ("  plain answer\n", [])
    assert split_tool_calls("", NAMES) == ("", [])


def test_whitespace_around_calls_alone_is_no_content():
    content, calls = split_tool_calls(f"\n{HERMES}\n\n{OURS}\n", NAMES)
    assert content is None and len(calls) == 2


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>',  # not one of the request's tools
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments must be an object
        '<tool_call>["add"]</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 1}}',  # never closed
    ],
)
def test_a_block_that_is_not_a_valid_call_stays_in_the_content(block):
    assert split_tool_calls(f"Hi {block}", NAMES) == (f"Hi {block}", [])


def test_parameters_and_string_arguments_are_read_too():
    text = (
        '<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>'
    )
    assert named(split_tool_calls(text, NAMES)[1]) == [("add", {"a": 1}), ("add", {"a": 2})]


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(
    "text",
    [
        f"Checking <tool_ the weather. {OURS}\n{HERMES} done <tool_call>{{oops}}</tool_call> <tool",
        f"\n\n{HERMES}\n",
        "  <tool_call is not a tag  \n",
        f"{OURS}  trailing",
    ],
)
def test_a_stream_reads_what_the_whole_text_reads(text, piece):
    content, calls = split_tool_calls(text, NAMES)
    streamed_content, streamed_calls = streamed(text, piece)
    assert streamed_content == (content or "")
    assert named(streamed_calls) == named(calls)


def test_a_stream_holds_back_what_may_open_a_call_and_gives_out_the_rest():
    parser = ToolCallParser(NAMES)
    assert parser.feed("It is <tool") == ("It is ", [])
    assert parser.feed("box> sunny") == ("<toolbox> sunny", [])
    content, calls = parser.feed(" " + OURS[:30])
    assert (content, calls) == (" ", [])  # the open block is held
    content, calls = parser.feed(OURS[30:])
    assert content == "" and named(calls) == [("get_weather", {"city": "Paris"})]


def test_the_opening_is_learnt_from_the_template():
    ours = build_tokenizer()
    assert ToolCallFormat.of(ours).opening == "<tool_call>"
    hermes = build_tokenizer()
    hermes.chat_template = HERMES_TEMPLATE
    assert ToolCallFormat.of(hermes).opening == "<tool_call>\n"
    plain = build_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert ToolCallFormat.of(plain) is None


def test_a_prefilled_call_reads_as_a_call_once_the_model_completes_it():
    tool_format = ToolCallFormat("<tool_call>\n")
    named_start = tool_format.prefill("get_weather")
    assert named_start == '<tool_call>\n{"name": "get_weather", "arguments": '
    content, calls = split_tool_calls(named_start + '{"city": "Oslo"}}\n</tool_call>', NAMES)
    assert content is None and named(calls) == [("get_weather", {"city": "Oslo"})]
    assert tool_format.prefill(None) == "<tool_call>\n"
