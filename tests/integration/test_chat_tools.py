"""Tools over `/v1/chat/completions`, driven by the official openai client against a real `asyncrl inference`.

The model is a tiny one taught by `asyncrl sft` (a real run, on a chat file this test writes) to call a weather
tool and then answer from its result, in our built-in template's format; greedy decoding makes it do so every
time. An agent loop runs the tool on the client's side and sends the result back as a `tool` message.
"""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
from servers import free_port, running_server

from asyncrl.models.offline import init_model

pytestmark = pytest.mark.integration

WEATHER = {"Paris": "sunny", "Oslo": "rainy"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Today's weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def get_weather(city: str) -> str:
    return WEATHER[city]


def conversation(city: str) -> dict:
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    messages = [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": get_weather(city)},
        {"role": "assistant", "content": f"It is {get_weather(city)} in {city}."},
    ]
    return {"messages": messages, "tools": TOOLS}


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    init_model(root / "tiny", "tiny", seed=0)
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(conversation(city)) + "\n" for city in WEATHER))
    sft = [sys.executable, "-m", "asyncrl", "sft", "--model.name", str(root / "tiny"), "--data.path", str(data)]
    sft += ["--data.epochs", "1000", "--data.batch_size", "2", "--max_steps", "80", "--optim.lr", "0.01"]
    sft += ["--optim.warmup_steps", "5", "--seq_len", "512", "--output_dir", str(root / "sft"), "--num_threads", "1"]
    sft += ["--device", "cpu"]  # the same model on every host: trained on a GPU, it made the T=20 test fail there
    result = subprocess.run(sft, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return root / "sft" / "final"


@pytest.fixture(scope="module")
def client(tool_model, tmp_path_factory):
    port = free_port()
    command = [sys.executable, "-m", "asyncrl", "inference", "--model.name", str(tool_model), "--port", str(port)]
    command += ["--seq-len", "512", "--num-threads", "1", "--device", "cpu", "--served-model-name", "tools"]
    with running_server(command, port, tmp_path_factory.mktemp("logs") / "inference.log", timeout=90) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def ask(client: openai.OpenAI, messages: list, **fields):
    return client.chat.completions.create(model="tools", messages=messages, tools=TOOLS, temperature=0, **fields)


@pytest.mark.parametrize("city", list(WEATHER))
def test_an_agent_loop_calls_the_tool_runs_it_and_answers_from_its_result(client, city):
    messages = [{"role": "user", "content": f"Weather in {city}?"}]
    for _ in range(3):
        choice = ask(client, messages).choices[0]
        if not choice.message.tool_calls:
            break
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        messages.append(choice.message.model_dump(exclude_none=True))  # the assistant's calls, as OpenAI sends
        for call in choice.message.tool_calls:
            result = {"get_weather": get_weather}[call.function.name](**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]) == {"city": city}
    assert choice.finish_reason == "stop" and choice.message.content == f"It is {WEATHER[city]} in {city}."


def test_a_streamed_call_arrives_in_openai_s_delta_shape(client):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    whole = ask(client, messages, logprobs=True).choices[0]
    chunks = list(ask(client, messages, stream=True, logprobs=True, stream_options={"include_usage": True}))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    calls = [call for delta in deltas for call in delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == whole.message.tool_calls[0].function.arguments == '{"city": "Oslo"}'
    assert deltas[0].role == "assistant" and not any(delta.content for delta in deltas)
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"
    streamed_logprobs = [
        e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert streamed_logprobs == [entry.logprob for entry in whole.logprobs.content]  # the call's tokens too
    assert chunks[-1].usage.completion_tokens == len(streamed_logprobs) + 1  # and <|im_end|>


def test_tool_choice_none_leaves_the_call_in_the_text(client):
    choice = ask(client, [{"role": "user", "content": "Weather in Paris?"}], tool_choice="none").choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_a_named_tool_choice_starts_the_call_and_the_model_writes_its_arguments(client):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    auto = ask(client, messages)
    named = ask(client, messages, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = named.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    opening = len('<tool_call>{"name": "get_weather", "arguments": ')  # one token per byte
    assert named.usage.prompt_tokens == auto.usage.prompt_tokens + opening
    required = ask(client, messages, tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls" and required.message.tool_calls[0].function.name == "get_weather"
    chunks = list(ask(client, messages, tool_choice="required", stream=True, stream_options={"include_usage": True}))
    [streamed] = chunks[0].choices[0].delta.tool_calls  # the whole answer, once valid, in one chunk
    assert (streamed.index, streamed.function.arguments) == (0, required.message.tool_calls[0].function.arguments)
    # ... and its finish reason in one of its own, as OpenAI and vLLM end a choice
    assert chunks[0].choices[0].finish_reason is None and chunks[1].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage.prompt_tokens > 0


def test_the_stream_helper_sees_a_required_call_s_arguments_done(client):
    """The official client's `chat.completions.stream()` fires `tool_calls.function.arguments.done` only for a
    call whose finish reason comes in a later chunk."""
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    with client.chat.completions.stream(
        model="tools", messages=messages, tools=TOOLS, temperature=0, tool_choice="required"
    ) as stream:
        done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
    assert [event.name for event in done] == ["get_weather"]
    assert json.loads(done[0].arguments) == {"city": "Oslo"}


def test_a_required_call_the_model_does_not_write_fails_after_its_attempts(client):
    # At temperature 20 the tiny model writes noise: three attempts, none a call, then a 422 naming tool_choice.
    with pytest.raises(openai.UnprocessableEntityError, match="no valid call of 'get_weather' in 3 attempts"):
        client.chat.completions.create(
            model="tools",
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=20,
            max_tokens=12,
            seed=1,
        )


def test_tool_choice_without_tools_or_naming_another_function_is_a_400(client):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model="tools", messages=messages, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="'get_time', which is not among the tools"):
        ask(client, messages, tool_choice={"type": "function", "function": {"name": "get_time"}})
