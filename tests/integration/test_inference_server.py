"""`asyncrl inference` as a real process on a tiny model, driven over HTTP and by the official openai client."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from servers import running_server  # tests/integration, on sys.path under pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.models.offline import init_model
from asyncrl.transport.weights import publish

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SEQ_LEN = 256
MAX_REQUEST_BYTES = 256 * 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def inference_command(model_dir, port: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "asyncrl",
        "inference",
        "--model.name",
        str(model_dir),
        "--port",
        str(port),
        "--seq-len",
        str(SEQ_LEN),
        "--num-threads",
        "1",
        "--device",
        "cpu",
        *flags,
    ]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("inference") / "tiny"
    init_model(path, "tiny", seed=0)
    return path


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory):
    port = free_port()
    env = {**os.environ, "ASYNCRL_ADMIN_TOKEN": ADMIN_TOKEN}
    log_path = tmp_path_factory.mktemp("logs") / "inference.log"
    command = inference_command(
        model_dir, port, "--served-model-name", "tiny", "--max-request-bytes", str(MAX_REQUEST_BYTES)
    )
    with running_server(command, port, log_path, env=env, timeout=60) as url:
        yield url


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server, timeout=30) as client:
        yield client


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def generate(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def teacher_forced_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


# ---- token route ----


def test_generate_logprobs_match_teacher_forcing(http, model_dir):
    prompt = [257, 84, 82, 68, 81, 198, 71, 72]
    result = generate(http, prompt_ids=prompt, n=2, temperature=0.8, top_k=30, max_tokens=16, seed=5)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert result["prompt_tokens"] == len(prompt) and len(result["choices"]) == 2
    for choice in result["choices"]:
        expected = teacher_forced_logprobs(model, prompt, choice["token_ids"], 0.8)
        assert torch.allclose(torch.tensor(choice["logprobs"]), expected, atol=1e-4)
        assert len(choice["policy_versions"]) == len(choice["token_ids"])


def test_generate_with_a_seed_is_reproducible(http):
    first = generate(http, prompt_ids=[1, 2, 3], n=2, max_tokens=12, seed=7)
    second = generate(http, prompt_ids=[1, 2, 3], n=2, max_tokens=12, seed=7)
    assert first == second
    assert first["choices"][0]["token_ids"] != first["choices"][1]["token_ids"]


def test_generate_stops_at_max_tokens_with_length(http):
    [choice] = generate(http, prompt_ids=[10, 11], max_tokens=5, temperature=0.0)["choices"]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 5


def test_a_prompt_longer_than_seq_len_is_a_400(http, client):
    response = http.post("/v1/generate", json={"prompt_ids": [1] * SEQ_LEN, "max_tokens": 1})
    assert response.status_code == 400
    assert "seq_len" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="seq_len"):
        client.completions.create(model="tiny", prompt="x" * SEQ_LEN, max_tokens=1)


def test_a_prompt_text_too_long_for_any_tokenization_is_refused_before_tokenizing(client):
    # No entry of the tiny vocabulary is longer than 13 characters ('<|endoftext|>'): 256 x 13 + 1 cannot fit.
    too_long = "x" * (SEQ_LEN * 13 + 1)
    with pytest.raises(openai.BadRequestError, match="3,329 characters cannot fit in the server's seq_len"):
        client.completions.create(model="tiny", prompt=too_long, max_tokens=1)
    messages = [{"role": "user", "content": too_long}]
    with pytest.raises(openai.BadRequestError, match="characters cannot fit") as refused:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert refused.value.body["param"] == "messages"


def test_inference_generate_speaks_vllm_s_token_route(http):
    body = {"token_ids": [3, 4, 5], "sampling_params": {"n": 2, "max_tokens": 6, "seed": 9, "logprobs": 2}}
    response = http.post("/inference/v1/generate", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    ours = generate(http, prompt_ids=[3, 4, 5], n=2, max_tokens=6, seed=9)
    assert result["usage"]["prompt_tokens"] == 3 and len(result["choices"]) == 2
    for choice, expected in zip(result["choices"], ours["choices"]):
        assert choice["token_ids"] == expected["token_ids"]
        content = choice["logprobs"]["content"]
        assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in expected["token_ids"]]
        assert [entry["logprob"] for entry in content] == expected["logprobs"]
        assert all(len(entry["top_logprobs"]) == 2 for entry in content)
        assert choice["policy_versions"] == expected["policy_versions"]


def test_a_misspelled_field_is_a_400(http):
    response = http.post("/v1/generate", json={"prompt_ids": [1], "max_token": 3})
    assert response.status_code == 400 and "max_token" in response.json()["error"]["message"]


# ---- OpenAI-compatible routes ----


def test_chat_completions_with_the_openai_client(client, tokenizer):
    messages = [{"role": "user", "content": "reverse: abc"}]
    response = client.chat.completions.create(
        model="tiny", messages=messages, n=3, max_tokens=8, logprobs=True, top_logprobs=2, seed=1
    )
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(response.choices) == 3
    assert response.usage.prompt_tokens == len(prompt)
    assert 3 <= response.usage.completion_tokens <= 24
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    for choice in response.choices:
        assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
        assert 0 < len(choice.logprobs.content) <= 8
        for entry in choice.logprobs.content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_without_the_prefix_cache_every_route_says_no_prompt_token_was_cached(client, http):
    messages = [{"role": "user", "content": "reverse: abcdefgh"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert [first.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens_details.cached_tokens] == [0, 0]
    prompt = [257, 84, 82, 68, 81, 198, 71, 72]
    answer = generate(http, prompt_ids=prompt, max_tokens=4, temperature=0)["choices"][0]
    again = generate(http, prompt_ids=prompt + answer["token_ids"], n=2, max_tokens=2)["choices"]
    assert [answer["cached_tokens"]] + [c["cached_tokens"] for c in again] == [0, 0, 0]


def test_chat_stop_string_cuts_the_text(client):
    request = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=24, seed=3)
    free = client.chat.completions.create(**request).choices[0].message.content
    stop = next(ch for ch in free[1:] if ch.isascii() and ch.isprintable())
    stopped = client.chat.completions.create(**request, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == free[: free.index(stop)]


def test_completions_with_the_openai_client(client):
    response = client.completions.create(model="tiny", prompt="hello", n=2, max_tokens=5, logprobs=2, seed=0)
    assert len(response.choices) == 2 and response.usage.prompt_tokens == 5
    for choice in response.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) <= 5
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert response.usage.completion_tokens <= 10


def test_completions_stop_string_cuts_the_text(client):
    request = dict(model="tiny", prompt="hello", max_tokens=24, seed=4)
    free = client.completions.create(**request).choices[0].text
    stop = next(ch for ch in free[1:] if ch.isascii() and ch.isprintable())
    stopped = client.completions.create(**request, stop=stop).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == free[: free.index(stop)]


def first_printable(text: str) -> str:
    return next(ch for ch in text[1:] if ch.isascii() and ch.isprintable())


def test_chat_streaming_adds_up_to_the_unstreamed_answer(client):
    request = dict(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=24, seed=3, logprobs=True
    )
    stop = first_printable(client.chat.completions.create(**request).choices[1].message.content)
    plain = client.chat.completions.create(**request, stop=[stop], top_logprobs=2)
    chunks = list(
        client.chat.completions.create(
            **request, stop=[stop], top_logprobs=2, stream=True, stream_options={"include_usage": True}
        )
    )
    text, logprobs, top, finish = ["", ""], [[], []], [[], []], [None, None]
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        text[choice.index] += choice.delta.content or ""
        for entry in choice.logprobs.content:
            logprobs[choice.index].append(entry.logprob)
            top[choice.index].append([alternative.token for alternative in entry.top_logprobs])
        finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert chunks[0].choices[0].delta.role == "assistant"
    assert plain.choices[1].finish_reason == "stop"
    for index, choice in enumerate(plain.choices):
        assert text[index] == choice.message.content
        assert finish[index] == choice.finish_reason
        assert logprobs[index] == [entry.logprob for entry in choice.logprobs.content]
        assert top[index] == [[alt.token for alt in entry.top_logprobs] for entry in choice.logprobs.content]


def test_completions_streaming_with_the_async_client(server):
    async def both() -> tuple:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="x")
        request = dict(model="tiny", prompt=["hello", "bye"], n=2, max_tokens=12, seed=11, logprobs=1)
        plain = await client.completions.create(**request)
        texts, logprobs = [""] * 4, [[] for _ in range(4)]
        async for chunk in await client.completions.create(**request, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                logprobs[choice.index] += choice.logprobs.token_logprobs
        await client.close()
        return plain, texts, logprobs

    plain, texts, logprobs = asyncio.run(both())
    assert len(plain.choices) == 4
    assert texts == [choice.text for choice in plain.choices]
    assert logprobs == [choice.logprobs.token_logprobs for choice in plain.choices]


def test_a_stream_that_cannot_start_is_a_plain_400(client):
    with pytest.raises(openai.BadRequestError, match="seq_len"):
        client.completions.create(model="tiny", prompt="x" * SEQ_LEN, max_tokens=1, stream=True)


def test_errors_have_openai_s_shape_and_exception_classes(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    assert bad.value.status_code == 400 and bad.value.param == "messages"
    assert set(bad.value.body) == {"message", "type", "param", "code"}
    assert bad.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("some-other-model")
    assert client.models.retrieve(client.models.list().data[0].id).owned_by == "asyncrl"


def test_min_p_one_keeps_only_the_likeliest_token(client):
    request = dict(model="tiny", prompt="hello", max_tokens=8, seed=0)
    greedy = client.completions.create(**request, temperature=0).choices[0].text
    assert client.completions.create(**request, temperature=1.0, extra_body={"min_p": 1.0}).choices[0].text == greedy


# ---- status ----


def test_health_and_metrics(http):
    health = http.get("/health").json()
    assert health["ready"] is True and health["model"].endswith("tiny")
    generate(http, prompt_ids=[1], max_tokens=3, temperature=0.0)
    metrics = dict(line.split() for line in http.get("/metrics").text.splitlines() if line and not line.startswith("#"))
    assert float(metrics["asyncrl_inference_generated_tokens_total"]) >= 3
    assert metrics["asyncrl_inference_policy_version"] == str(health["policy_version"])
    assert float(metrics["asyncrl_inference_prompt_tokens_total"]) >= 1
    gauges = ("running_requests", "waiting_requests", "kv_cache_used_tokens", "kv_cache_total_tokens", "paused")
    assert {f"asyncrl_inference_{name}" for name in gauges} <= metrics.keys()
    assert float(metrics["asyncrl_inference_kv_cache_total_tokens"]) > 0


# ---- admin ----


def test_admin_routes_need_the_token(http):
    assert http.post("/admin/pause").status_code == 401
    response = http.post("/admin/pause", headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401 and "token" in response.json()["error"]["message"]


def test_admin_routes_are_disabled_without_a_token(model_dir, monkeypatch):
    from fastapi.testclient import TestClient

    from asyncrl.config.schema import InferenceConfig
    from asyncrl.inference.api.server import create_app
    from asyncrl.inference.backends.native_backend import NativeBackend
    from asyncrl.inference.engine.engine import Engine

    monkeypatch.delenv("ASYNCRL_ADMIN_TOKEN", raising=False)
    cfg = InferenceConfig(model={"name": str(model_dir)}, device="cpu")
    engine = Engine(cfg)
    try:
        response = TestClient(create_app(NativeBackend(engine), cfg)).post("/admin/pause", headers=ADMIN)
    finally:
        engine.stop()
    assert response.status_code == 403
    assert "ASYNCRL_ADMIN_TOKEN" in response.json()["error"]["message"]


def test_paused_requests_wait_and_finish_after_resume(http):
    assert http.post("/admin/pause", headers=ADMIN).json()["paused"] is True
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(generate, http, prompt_ids=[1, 2], max_tokens=4)
            time.sleep(0.5)
            assert not pending.done()
            assert "asyncrl_inference_waiting_requests 1" in http.get("/metrics").text
            assert http.post("/admin/resume", headers=ADMIN).status_code == 200
            assert len(pending.result(timeout=30)["choices"][0]["token_ids"]) >= 1
    finally:
        http.post("/admin/resume", headers=ADMIN)


def test_update_weights_makes_a_new_policy_version_live(http, model_dir, tokenizer, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    folder = publish(tmp_path, 1, model.state_dict(), model.config, tokenizer)
    response = http.post("/admin/update_weights", headers=ADMIN, json={"path": str(folder), "version": 1})
    try:
        assert response.status_code == 200 and response.json() == {"policy_version": 1}
        assert http.get("/health").json()["policy_version"] == 1
        prompt = [5, 6, 7]
        [choice] = generate(http, prompt_ids=prompt, max_tokens=8, temperature=0.9, seed=0)["choices"]
        assert set(choice["policy_versions"]) == {1}
        expected = teacher_forced_logprobs(model, prompt, choice["token_ids"], 0.9)
        assert torch.allclose(torch.tensor(choice["logprobs"]), expected, atol=1e-4)
    finally:  # later tests expect the base weights
        model.load_state_dict(base)
        restored = publish(tmp_path, 2, model.state_dict(), model.config, tokenizer)
        http.post("/admin/update_weights", headers=ADMIN, json={"path": str(restored), "version": 2})


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f"asyncrl_inference_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_a_request_in_flight_is_paused_then_finishes_under_the_new_weights(http, model_dir, tokenizer, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter, generator=torch.Generator().manual_seed(2)))
    folder = publish(tmp_path, 7, model.state_dict(), model.config, tokenizer)
    old_version = http.get("/health").json()["policy_version"]
    before = metric(http, "generated_tokens_total")
    try:
        with ThreadPoolExecutor(1) as pool:
            # Greedy decoding of this prompt never meets EOS with the base weights: the request runs long.
            pending = pool.submit(generate, http, prompt_ids=[5, 6, 7], max_tokens=SEQ_LEN - 3, temperature=0.0)
            deadline = time.monotonic() + 60
            while metric(http, "generated_tokens_total") < before + 5 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert http.post("/admin/pause", headers=ADMIN).status_code == 200
            done_before_pause = metric(http, "generated_tokens_total") - before
            time.sleep(0.3)
            assert metric(http, "generated_tokens_total") - before == done_before_pause  # paused, not dropped
            assert not pending.done()
            update = http.post("/admin/update_weights", headers=ADMIN, json={"path": str(folder), "version": 7})
            assert update.status_code == 200
            assert http.post("/admin/resume", headers=ADMIN).status_code == 200
            [choice] = pending.result(timeout=120)["choices"]
        old = int(done_before_pause)
        assert 5 <= old < len(choice["token_ids"])
        assert choice["policy_versions"] == [old_version] * old + [7] * (len(choice["token_ids"]) - old)
    finally:  # later tests expect the base weights
        http.post("/admin/resume", headers=ADMIN)
        model.load_state_dict(base)
        restored = publish(tmp_path, 8, model.state_dict(), model.config, tokenizer)
        http.post("/admin/update_weights", headers=ADMIN, json={"path": str(restored), "version": 8})


def test_update_weights_from_a_missing_folder_is_refused_and_serving_goes_on(http, tmp_path):
    version = http.get("/health").json()["policy_version"]
    missing = tmp_path / "weights" / "step_9"
    response = http.post("/admin/update_weights", headers=ADMIN, json={"path": str(missing), "version": 9})
    assert response.status_code == 400
    assert str(missing) in response.json()["error"]["message"]
    assert http.get("/health").json()["policy_version"] == version
    assert generate(http, prompt_ids=[1], max_tokens=2)["choices"][0]["policy_versions"] == [version] * 2


# ---- startup ----


def test_a_port_in_use_fails_with_one_line(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(inference_command(model_dir, port), capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr.strip().splitlines()[-1]


def test_the_vllm_backend_without_vllm_fails_with_one_line(model_dir):
    # This test's Python (the project's venv) has no vllm; the vLLM backend must say so before starting it.
    command = [*inference_command(model_dir, 0), "--backend", "vllm", "--vllm.python", sys.executable]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"vllm is not installed for {sys.executable}" in result.stderr.strip().splitlines()[-1]


# ---- clients that go away ----


def wait_for_metric(http: httpx.Client, name: str, condition, timeout: float = 30) -> float:
    deadline = time.monotonic() + timeout
    while not condition(value := metric(http, name)):
        assert time.monotonic() < deadline, f"{name} stayed at {value}"
        time.sleep(0.01)
    return value


def test_a_client_that_disconnects_mid_generation_stops_its_samples(server, http):
    # Many samples make each step slow enough that the client's leaving is seen within a few dozen steps even
    # on a loaded 2-core machine (16 samples took a fast step each, and CI saw the cancel only ~140 steps in).
    samples, max_tokens = 128, SEQ_LEN - 3
    # Tokens are counted server-wide: samples an earlier test left decoding must end before counting starts.
    wait_for_metric(http, "running_sequences", lambda running: running == 0)
    before = metric(http, "generated_tokens_total")

    async def disconnect_mid_way() -> None:
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            # Greedy decoding of this prompt never meets EOS with the base weights: the request runs long.
            body = {"prompt_ids": [5, 6, 7], "n": samples, "max_tokens": max_tokens, "temperature": 0.0}
            request = asyncio.create_task(client.post("/v1/generate", json=body))
            while metric(http, "generated_tokens_total") < before + 2 * samples:
                assert not request.done(), "the request finished before the client could leave"
                await asyncio.sleep(0.005)
            request.cancel()  # closes the connection, as a client's timeout does
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(disconnect_mid_way())
    wait_for_metric(http, "running_sequences", lambda running: running == 0, timeout=10)
    generated = metric(http, "generated_tokens_total") - before
    assert generated < samples * max_tokens / 2  # the rest of each sample was never decoded


def test_a_request_queued_while_paused_is_dropped_when_its_client_times_out(http):
    assert http.post("/admin/pause", headers=ADMIN).status_code == 200
    try:
        with pytest.raises(httpx.TimeoutException):
            http.post("/v1/generate", json={"prompt_ids": [1, 2], "n": 3, "max_tokens": 4}, timeout=0.5)
        wait_for_metric(http, "waiting_sequences", lambda waiting: waiting == 0, timeout=10)
    finally:
        http.post("/admin/resume", headers=ADMIN)
    assert metric(http, "waiting_requests") == 0


def test_a_request_paused_in_flight_is_dropped_when_its_client_disconnects(server, http):
    before = metric(http, "generated_tokens_total")

    async def disconnect_while_paused() -> None:
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            body = {"prompt_ids": [5, 6, 7], "n": 2, "max_tokens": SEQ_LEN - 3, "temperature": 0.0}
            request = asyncio.create_task(client.post("/v1/generate", json=body))
            while metric(http, "generated_tokens_total") < before + 4:
                await asyncio.sleep(0.005)
            assert http.post("/admin/pause", headers=ADMIN).status_code == 200
            assert metric(http, "running_sequences") == 2
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request

    try:
        asyncio.run(disconnect_while_paused())
        wait_for_metric(http, "running_sequences", lambda running: running == 0, timeout=10)
        assert metric(http, "kv_cache_used_tokens") == 0
    finally:
        http.post("/admin/resume", headers=ADMIN)


# ---- hostile and careless clients ----

GENERATE_ROUTES = {
    "/v1/generate": lambda **fields: {"prompt_ids": [5, 6, 7], **fields},
    "/inference/v1/generate": lambda **fields: {"token_ids": [5, 6, 7], "sampling_params": fields},
    "/v1/completions": lambda **fields: {"prompt": "abc", **fields},
    "/v1/chat/completions": lambda **fields: {"messages": [{"role": "user", "content": "abcd"}], **fields},
}


def assert_openai_error(response: httpx.Response, status: int, text: str = "") -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json", response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert text in error["message"]
    return error


@pytest.mark.parametrize("route", GENERATE_ROUTES)
@pytest.mark.parametrize(
    "field, value",
    [("top_k", 1e30), ("top_k", 2**64), ("max_tokens", 2**63), ("seed", 2**70), ("temperature", 1e400), ("n", 0)],
)
def test_an_out_of_range_sampling_value_is_a_400(http, route, field, value):
    body = json.dumps(GENERATE_ROUTES[route](**{"max_tokens": 2, field: value}))  # 1e400 is "Infinity"
    assert_openai_error(http.post(route, content=body, headers={"content-type": "application/json"}), 400, field)


def test_a_bad_request_among_good_ones_fails_alone(server):
    async def mixed() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            good = [client.post("/v1/generate", json={"prompt_ids": [5, 6, 7], "n": 4, "max_tokens": 64})] * 3
            bad = [client.post(route, json=body(max_tokens=4, top_k=2**64)) for route, body in GENERATE_ROUTES.items()]
            return await asyncio.gather(*good, *bad)

    responses = asyncio.run(mixed())
    assert [r.status_code for r in responses] == [200] * 3 + [400] * len(GENERATE_ROUTES)
    assert all(len(r.json()["choices"]) == 4 for r in responses[:3])


def test_a_body_over_max_request_bytes_is_a_413(http):
    prompt = "x" * MAX_REQUEST_BYTES
    assert_openai_error(http.post("/v1/completions", json={"prompt": prompt}), 413, "inference.max_request_bytes")

    def chunks():  # no content-length: the server counts as the body streams in
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 4096 + 1):
            yield b"x" * 4096
        yield b'"}'

    streamed = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(streamed, 413, "inference.max_request_bytes")


def test_n_and_stop_strings_have_configurable_caps(http):
    assert_openai_error(http.post("/v1/generate", json={"prompt_ids": [1], "n": 129}), 400, "inference.max_n")
    several = {"prompt": ["a", "b", "c"], "n": 50, "max_tokens": 1}
    assert_openai_error(http.post("/v1/completions", json=several), 400, "inference.max_n")
    many = {"prompt": "a", "stop": [f"s{i}" for i in range(17)], "max_tokens": 1}
    assert_openai_error(http.post("/v1/completions", json=many), 400, "inference.max_stop_strings")
    long = {"prompt": "a", "stop": ["s" * 65], "max_tokens": 1}
    assert_openai_error(http.post("/v1/completions", json=long), 400, "inference.max_stop_string_length")


def test_health_answers_at_once_while_heavy_requests_are_tokenized(server, http):
    text = "abcdefgh " * (MAX_REQUEST_BYTES // 10)  # 1 token per byte: long to tokenize, then too long to serve
    latencies: list[float] = []

    async def flood() -> list[int]:
        async with httpx.AsyncClient(base_url=server, timeout=120) as client:
            body = {"messages": [{"role": "user", "content": text}]}
            heavy = [asyncio.create_task(client.post("/v1/chat/completions", json=body)) for _ in range(8)]
            while not all(task.done() for task in heavy):
                started = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(0.02)
            return [task.result().status_code for task in heavy]

    assert asyncio.run(flood()) == [400] * 8  # longer than seq_len (found before tokenizing, by its length)
    # Tokenized on the event loop, the 8 requests held it for seconds; now their length alone refuses them, so
    # they end within a few probes. A loaded 2-core machine needs the margin.
    assert latencies and max(latencies) < 2.0, sorted(latencies)[-5:]


def test_health_answers_at_once_while_a_large_answer_is_built(server, http):
    # 128 samples x 100 tokens x 21 logprob entries: ~10 MB of JSON to build and write.
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 128, "max_tokens": 100, "logprobs": True}
    latencies: list[float] = []

    async def heavy_answer() -> int:
        async with httpx.AsyncClient(base_url=server, timeout=300) as client:
            answer = asyncio.create_task(client.post("/v1/chat/completions", json={**body, "top_logprobs": 20}))
            while not answer.done():
                started = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(0.02)
            return (await answer).status_code

    assert asyncio.run(heavy_answer()) == 200
    assert max(latencies) < 2.0, sorted(latencies)[-5:]  # built and written on the event loop: ~10 s


def test_a_good_client_is_served_beside_200_hostile_ones_and_8_that_leave(server):
    """200 clients each send a chat body just under max_request_bytes (one long text, or thousands of short
    messages for the template to render) and 8 leave while their messages are rendered. A good request beside
    them is answered and /health stays responsive. Bounds are generous for a loaded 2-core machine; the goals
    (good <= 2 s, /health <= 100 ms) are measured on an idle one by benchmarks/hostile_load.py."""
    text = {"messages": [{"role": "user", "content": "abcdefgh " * ((MAX_REQUEST_BYTES - 64) // 9)}]}
    messages = {"messages": [{"role": "user", "content": "hi"}] * ((MAX_REQUEST_BYTES - 64) // 35)}
    bodies = [json.dumps(body).encode() for body in (text, messages)]
    assert all(MAX_REQUEST_BYTES - 1024 < len(body) < MAX_REQUEST_BYTES for body in bodies)
    headers = {"content-type": "application/json"}
    health: list[float] = []

    async def crowd() -> tuple[list, list[int], float]:
        limits = httpx.Limits(max_connections=220)
        async with (
            httpx.AsyncClient(base_url=server, timeout=120, limits=limits) as hostile,
            httpx.AsyncClient(base_url=server, timeout=120) as polite,
        ):

            async def leave() -> str:
                with pytest.raises(httpx.TimeoutException):
                    await hostile.post("/v1/chat/completions", content=bodies[1], headers=headers, timeout=0.2)
                return "left"

            async def post(body: bytes) -> int:
                return (await hostile.post("/v1/chat/completions", content=body, headers=headers)).status_code

            async def probe() -> None:
                while not all(task.done() for task in tasks):
                    started = time.perf_counter()
                    assert (await polite.get("/health")).status_code == 200
                    health.append(time.perf_counter() - started)
                    await asyncio.sleep(0.05)

            tasks = [asyncio.create_task(post(bodies[i % 2])) for i in range(200)]
            tasks += [asyncio.create_task(leave()) for _ in range(8)]
            prober = asyncio.create_task(probe())
            await asyncio.sleep(0.5)  # the crowd's bodies are arriving
            started = time.perf_counter()
            good = await polite.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                   "max_tokens": 4})  # fmt: skip
            good_s = time.perf_counter() - started
            await prober
            return [task.result() for task in tasks], [good.status_code], good_s

    answers, good, good_s = asyncio.run(asyncio.wait_for(crowd(), 300))
    assert Counter(answers) == {400: 200, "left": 8}  # longer than seq_len, each refused
    assert good == [200] and good_s < 30, good_s
    assert health and max(health) < 5.0, sorted(health)[-5:]


@pytest.mark.parametrize(
    "route, body, param",
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab\ud800cd"}]}, "messages"),
        ("/v1/completions", {"prompt": "ab\ud800cd"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "ab\ud800cd"]}, "prompt"),
        ("/v1/generate", {"prompt_ids": [1], "\ud800": 1}, None),
    ],
)
def test_malformed_text_is_a_400_in_openai_s_shape(http, route, body, param):
    raw = json.dumps(body).replace("\\\\ud800", "\\ud800")  # a lone surrogate, as JSON allows
    response = http.post(route, content=raw, headers={"content-type": "application/json"})
    error = assert_openai_error(response, 400)
    assert param is None or error["param"].startswith(param)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/generate"])
def test_a_large_body_is_validated_like_a_small_one(http, route):
    """Bodies past a few KB are decoded and validated on a prompt thread, not on the event loop: the same 400s."""
    padding = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}] * 500},
        "/v1/completions": {"prompt": ["hi"] * 2000},
        "/v1/generate": {"prompt_ids": [5] * 2000},
    }[route]
    for extra, param in [({"temperature": "hot"}, "temperature"), ({"max_tokens": -1}, "max_tokens")]:
        small, large = json.dumps(GENERATE_ROUTES[route](**extra)), json.dumps({**padding, **extra})
        assert len(small) < 4096 < len(large)
        for body in (small, large):
            response = http.post(route, content=body, headers={"content-type": "application/json"})
            assert assert_openai_error(response, 400)["param"] == param, body[:80]
    assert_openai_error(http.post(route, content=b"{" + b" " * 8192), 400)  # not JSON


def test_a_chat_body_over_64_kib_is_prepared_in_a_worker_process_as_the_server_would(http, tokenizer):
    """Past 64 KiB a chat body is decoded, validated and rendered in a worker process (chat_processes.py): the
    same answer as the server's own path, and the same 400s."""
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"}]
    padding = "x" * 70_000  # a field outside OpenAI's API: ignored, but it makes the body large
    before = metric(http, "chat_process_bodies_total")
    answers = []
    for extra in ({}, {"padding": padding}):
        body = {"messages": conversation, "max_tokens": 6, "temperature": 0.0, **extra}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        answers.append(response.json())
    assert metric(http, "chat_process_bodies_total") == before + 1  # the large one only
    small, large = answers
    assert large["choices"][0]["message"] == small["choices"][0]["message"]
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    expected = len(tokenizer.encode(text, add_special_tokens=False))
    assert large["usage"]["prompt_tokens"] == small["usage"]["prompt_tokens"] == expected

    for extra, param in [
        ({"temperature": "hot"}, "temperature"),  # validation
        ({"audio": {"voice": "x"}}, "audio"),  # a field this server does not do
        ({"messages": [{"role": "user", "content": "ab\ud800cd"}]}, "messages"),  # no tokenizer encodes it
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ]:
        body = {"messages": conversation, "padding": padding, **extra}
        raw = json.dumps(body)  # the lone surrogate as JSON writes it: \ud800
        response = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert assert_openai_error(response, 400)["param"] == param, response.text
    assert_openai_error(http.post("/v1/chat/completions", content=b"{" + b" " * 70_000), 400)  # not JSON


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe", b""])
def test_a_body_that_is_not_a_json_object_is_a_400(http, body):
    assert_openai_error(http.post("/v1/chat/completions", content=body), 400)


def test_tiny_temperature_and_top_p_sample_the_most_likely_token(http):
    greedy = generate(http, prompt_ids=[5, 6, 7], max_tokens=8, temperature=0.0)["choices"][0]
    for extreme in ({"temperature": 1e-38}, {"top_p": 1e-46, "seed": 3}):
        [choice] = generate(http, prompt_ids=[5, 6, 7], max_tokens=8, **extreme)["choices"]
        assert choice["token_ids"] == greedy["token_ids"], extreme
        assert all(math.isfinite(logprob) for logprob in choice["logprobs"])


def test_the_model_is_served_under_its_served_model_name(http, client):
    assert [card.id for card in client.models.list().data] == ["tiny"]
    assert http.get("/health").json()["model"] == "tiny"
    for route, body in GENERATE_ROUTES.items():
        if route != "/v1/generate":  # our own route takes no model
            response = http.post(route, json={**body(max_tokens=1), "model": "other"})
            assert_openai_error(response, 404, "'other'")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="models/tiny", messages=[{"role": "user", "content": "hi"}])


def test_update_weights_refuses_bad_values_and_versions_and_keeps_serving(http, model_dir, tokenizer, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    version = http.get("/health").json()["policy_version"]
    state = model.state_dict()
    nan = {**state, "model.norm.weight": torch.full_like(state["model.norm.weight"], float("nan"))}
    embedding = state["model.embed_tokens.weight"].clone().index_fill_(0, torch.tensor([3]), math.inf)
    inf = {**state, "model.embed_tokens.weight": embedding}
    ints = {**state, "model.norm.weight": state["model.norm.weight"].long()}
    for step, weights, problem in ((101, nan, "NaN"), (102, inf, "infinite"), (103, ints, "torch.int64")):
        folder = publish(tmp_path, step, weights, model.config, tokenizer)
        response = http.post("/admin/update_weights", headers=ADMIN, json={"path": str(folder), "version": step})
        assert_openai_error(response, 400, problem)
    good = publish(tmp_path, 104, state, model.config, tokenizer)
    for bad_version, problem in ((version - 1, "older than"), (10**23, "version")):
        if bad_version < 0:
            continue
        response = http.post("/admin/update_weights", headers=ADMIN, json={"path": str(good), "version": bad_version})
        assert_openai_error(response, 400, problem)
    assert http.get("/health").json()["policy_version"] == version
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    response = http.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200 and response.json()["choices"][0]["logprobs"]["content"]


# ---- who may use it ----

API_KEY = "test-api-key"


@pytest.fixture(scope="module")
def keyed_server(model_dir, tmp_path_factory):
    port = free_port()
    command = inference_command(model_dir, port, "--api-key", API_KEY)  # served under its path
    log_path = tmp_path_factory.mktemp("logs") / "keyed.log"
    with running_server(command, port, log_path, timeout=60) as url:
        yield url


def test_an_api_key_guards_the_openai_and_generate_routes(keyed_server, model_dir):
    key = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=keyed_server, timeout=30) as http:
        for route, body in GENERATE_ROUTES.items():
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
                assert_openai_error(http.post(route, json=body(max_tokens=1), headers=headers), 401, "API key")
            assert http.post(route, json=body(max_tokens=1), headers=key).status_code == 200
        assert_openai_error(http.get("/v1/models"), 401)
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="wrong").models.list()
    [card] = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key=API_KEY).models.list().data
    assert card.id == str(model_dir)  # no served_model_name: the model's name


def test_listening_beyond_loopback_without_a_key_warns(caplog):
    from asyncrl.config.schema import InferenceConfig
    from asyncrl.inference.api.auth import warn_if_exposed

    open_config, keyed_config = InferenceConfig(), InferenceConfig(api_key="k")
    for address, config, warned in (
        ("0.0.0.0", open_config, True),
        ("::", open_config, True),
        ("127.0.0.1", open_config, False),
        ("::1", open_config, False),
        ("0.0.0.0", keyed_config, False),
    ):
        caplog.clear()
        warn_if_exposed(config, address)
        assert ("without an API key" in caplog.text) == warned, address


# ---- OpenAI fields: each implemented, or refused with a 400 naming it ----

CHAT = {"messages": [{"role": "user", "content": "abcd"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "route, fields, param",
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            "messages[0].content[0]",
        ),
        ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
        ("/v1/chat/completions", {"verbosity": "low"}, "verbosity"),
        ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
        ("/v1/chat/completions", {"store": True}, "store"),
        ("/v1/chat/completions", {"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0]"),
        ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/chat/completions", {"frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"suffix": "x"}, "suffix"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"logit_bias": {"999999": 1}}, None),  # outside the vocabulary
    ],
)
def test_a_field_asking_what_the_server_does_not_do_is_a_400_naming_it(http, route, fields, param):
    body = {**CHAT, **fields} if route == "/v1/chat/completions" else {"prompt": "ab", "max_tokens": 2, **fields}
    error = assert_openai_error(http.post(route, json=body), 400)
    assert param is None or error["param"].startswith(param), error
    assert "logit_bias" in error["message"] if param is None else True


def test_labels_and_neutral_values_of_openai_fields_are_accepted(http):
    labels = {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "safety_identifier": "s"}
    neutral = {"response_format": {"type": "text"}, "modalities": ["text"], "parallel_tool_calls": False}
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]
    body = {**CHAT, **labels, **neutral, "prompt_cache_key": "p", "messages": [{"role": "user", "content": parts}]}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    completion = {"prompt": "ab", "max_tokens": 2, "best_of": 2, "n": 2, "user": "u"}
    assert len(http.post("/v1/completions", json=completion).json()["choices"]) == 2


def test_logit_bias_steers_every_route(http, client, tokenizer):
    token = tokenizer.encode("z")[0]
    for route, body in GENERATE_ROUTES.items():
        response = http.post(route, json=body(max_tokens=4, temperature=0.0, logit_bias={str(token): 100}))
        assert response.status_code == 200, (route, response.text)
        choice = response.json()["choices"][0]
        assert choice.get("token_ids", [token] * 4) == [token] * 4, route
        assert choice.get("text", choice.get("message", {}).get("content", "zzzz")) == "zzzz", route
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, logit_bias={str(token): 100}
    )
    assert reply.choices[0].message.content == "zzz"


def test_a_presence_penalty_keeps_greedy_decoding_from_repeating_tokens(http):
    plain = generate(http, prompt_ids=[5, 6, 7], max_tokens=24, temperature=0.0)["choices"][0]["token_ids"]
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself
    # Its logits span less than 2: a token it has generated falls behind every one it has not.
    fields = {"max_tokens": 24, "temperature": 0.0, "presence_penalty": 2.0, "ignore_eos": True}
    penalized = generate(http, prompt_ids=[5, 6, 7], **fields)["choices"][0]["token_ids"]
    assert len(set(penalized)) == len(penalized) == 24


def test_ignore_eos_holds_on_the_openai_routes_as_on_generate(client, model_dir):
    """vLLM's extension: with EOS made certain by a bias, a completion stops at once, unless it ignores EOS."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<|im_end|>")
    fields = {"model": "tiny", "max_tokens": 5, "logit_bias": {str(eos): 100}}
    messages = [{"role": "user", "content": "hi"}]
    stopped = client.chat.completions.create(messages=messages, **fields)
    ignored = client.chat.completions.create(messages=messages, extra_body={"ignore_eos": True}, **fields)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 5
    completion = client.completions.create(prompt="hi", extra_body={"ignore_eos": True}, **fields)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 5


@pytest.mark.parametrize(
    ("message", "param", "why"),
    [
        ({"role": "wizard", "content": "hi"}, "messages[0].role", "role 'wizard' is not one of"),
        ({"role": "user"}, "messages[0].content", "a user message needs its content"),
        ({"role": "tool", "content": None}, "messages[0].content", "a tool message needs its content"),
    ],
    ids=["unknown role", "user without content", "tool without content"],
)
def test_a_message_openai_refuses_is_a_400_naming_it(client, message, param, why):
    with pytest.raises(openai.BadRequestError, match=why) as bad:
        client.chat.completions.create(model="tiny", messages=[message], max_tokens=2)
    assert bad.value.param == param


def test_an_assistant_message_may_call_tools_without_content(client):
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    assert client.chat.completions.create(model="tiny", messages=messages, max_tokens=2).choices


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"temperature": "hot"}, "temperature"),
    ],
    ids=["union of literals", "union member of a list item", "plain field"],
)
def test_a_malformed_field_is_named_as_the_request_spells_it(http, fields, param):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
