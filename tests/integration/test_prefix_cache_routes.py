"""Every route says how many prompt tokens came from the prefix cache: `asyncrl inference` with the paged layout
and the prefix cache on, on a tiny model, driven over HTTP, by the official openai client and by a multi-turn
environment. A request whose tokens start like an earlier prompt or sample (a second turn) reads whole blocks
of them from the cache: all but the prompt's last token, which its prefill computes for the logits."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from servers import free_port, inference_command, running_server  # tests/integration, on sys.path under pytest

from asyncrl.config.schema import SamplingConfig
from asyncrl.environments import load_environment
from asyncrl.loading import load_tokenizer
from asyncrl.models.offline import init_model
from asyncrl.orchestrator.batch import Batch, batch_metrics
from asyncrl.orchestrator.client import InferenceClient, ServedPolicy
from asyncrl.orchestrator.queue import ScoredGroup

pytestmark = pytest.mark.integration

BLOCK = 4  # tokens per KV-cache block: small, so that a short prompt fills several
SEQ_LEN = 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix_cache") / "tiny"
    init_model(path, "tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = free_port()
    flags = ("--device", "cpu", "--seq-len", str(SEQ_LEN), "--served-model-name", "tiny")
    cache = ("--kv_cache_layout", "paged", "--kv_block_size", str(BLOCK), "--prefix_cache", "true")
    command = inference_command(model_dir, port, *flags, *cache)
    with running_server(command, port, tmp_path_factory.mktemp("logs") / "inference.log") as url:
        yield url


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x")


def post(http: httpx.Client, route: str, **body) -> dict:
    response = http.post(route, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def whole_blocks(tokens: int) -> int:
    return tokens // BLOCK * BLOCK


def test_generate_choices_say_how_many_prompt_tokens_came_from_the_cache(http):
    prompt = [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]  # each test's prompts start apart
    first = post(http, "/v1/generate", prompt_ids=prompt, max_tokens=6, temperature=0)
    [answer] = first["choices"]
    assert answer["cached_tokens"] == 0
    # A second turn: the first prompt, its answer, then the user's tokens. The answer's blocks were registered
    # when it ended: all its written tokens (every one but the newest) in whole blocks.
    second_turn = prompt + answer["token_ids"] + [99, 100]
    second = post(http, "/v1/generate", prompt_ids=second_turn, n=2, max_tokens=4, temperature=1.0, seed=3)
    written = len(prompt) + len(answer["token_ids"]) - 1
    assert [c["cached_tokens"] for c in second["choices"]] == [whole_blocks(written)] * 2
    assert whole_blocks(written) >= len(prompt)


def test_completions_usage_counts_each_prompts_cached_tokens_once(http):
    prompt = [30, 31, 32, 33, 34, 35, 36, 37]  # two whole blocks, registered after its prefill
    first = post(http, "/v1/completions", prompt=prompt, max_tokens=1, temperature=0)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    fresh = [40, 41, 42, 43, 44, 45]
    second = post(http, "/v1/completions", prompt=[prompt + [38, 39], fresh], n=2, max_tokens=2, temperature=1.0)
    assert len(second["choices"]) == 4
    assert second["usage"]["prompt_tokens"] == 10 + 6
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": len(prompt)}  # not once per sample


def test_the_vllm_token_route_counts_the_prompts_cached_tokens_once(http):
    prompt = [50, 51, 52, 53, 54, 55, 56, 57, 58]
    post(http, "/inference/v1/generate", token_ids=prompt, sampling_params={"max_tokens": 1, "temperature": 0})
    again = post(http, "/inference/v1/generate", token_ids=prompt, sampling_params={"n": 3, "max_tokens": 2})
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": whole_blocks(len(prompt) - 1)}


def test_a_chat_conversations_second_turn_reads_the_first_from_the_cache(client):
    messages = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "More"},
    ]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # At least the first turn's prompt (the template renders it again, unchanged), in whole blocks.
    assert cached >= whole_blocks(first.usage.prompt_tokens) > 0 and cached % BLOCK == 0
    # The same turn again, streamed: now every block of its prompt but the one of its last token is cached.
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert [u.prompt_tokens_details.cached_tokens for u in usage] == [whole_blocks(second.usage.prompt_tokens - 1)]


def test_every_turn_of_a_multi_turn_episode_reads_the_turn_before_from_the_cache(server, model_dir):
    """A group's episodes all talk to one server, and each turn's prompt is the previous prompt, its sampled
    tokens and the environment's tokens: its prefill reads the previous turn's blocks from the cache."""

    class RecordingPolicy(ServedPolicy):
        def __init__(self, *args):
            super().__init__(*args)
            self.turns: list[tuple[list[int], list[int], int]] = []  # (prompt, sampled, cached) per sample

        async def generate(self, prompt_ids, n, max_tokens=None, seed=None):
            completions = await super().generate(prompt_ids, n, max_tokens, seed)
            self.turns += [(list(prompt_ids), c.token_ids, c.cached_tokens) for c in completions]
            return completions

    async def play() -> tuple[RecordingPolicy, list]:
        client = InferenceClient(server, None, request_timeout=120)
        policy = RecordingPolicy(client, load_tokenizer(str(model_dir)), SamplingConfig(max_tokens=8), SEQ_LEN)
        env = load_environment("wordle", max_turns=3)
        try:
            rollouts = await env.rollout_group(next(env.examples(seed=1)), policy.seeded(0), 2)
        finally:
            await client.close()
        return policy, rollouts

    policy, rollouts = asyncio.run(play())
    turns = policy.turns
    # The rollouts count what their requests sent (a group's first prompt once) and what the cache served.
    first_prompt = len(turns[0][0])
    prompt_tokens = first_prompt + sum(len(p) for p, _, _ in turns[2:])  # turns[:2]: the group's one request
    assert sum(r.prompt_tokens for r in rollouts) == prompt_tokens
    assert sum(r.cached_tokens for r in rollouts) == sum(cached for _, _, cached in turns) > 0
    metrics = batch_metrics(Batch(1, [ScoredGroup(0, "wordle", None, rollouts, [0.0, 0.0])], 0), 0)
    assert metrics["prefix_cache/prompt_tokens"] == prompt_tokens
    assert 0 < metrics["prefix_cache/hit_rate"] == metrics["prefix_cache/cached_tokens"] / prompt_tokens < 1
    later = 0
    for prompt, _, cached in turns:
        earlier = [p + s for p, s, _ in turns if len(p + s) < len(prompt) and prompt[: len(p + s)] == p + s]
        if not earlier:
            continue  # a first turn
        later += 1
        written = max(len(tokens) for tokens in earlier) - 1  # the previous turn's tokens but its newest
        assert cached >= whole_blocks(written) and cached % BLOCK == 0
    assert later >= 2, "garbage guesses should keep both games going"
