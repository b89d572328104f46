"""Chat bodies prepared in worker processes (chat_processes.py), for real: a tiny model's tokenizer, real worker
processes, bodies as the server receives them."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
from fastapi.exceptions import RequestValidationError

from asyncrl.inference.api.api_errors import APIError
from asyncrl.inference.api.chat_processes import PROCESS_BYTES, ChatProcesses
from asyncrl.inference.api.chat_template import render_chat
from asyncrl.inference.api.protocol import ChatBody
from asyncrl.loading import load_tokenizer
from asyncrl.models.offline import init_model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "tiny"
    init_model(path, "tiny", seed=0)
    return str(path)


def chat(messages: int, **fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}] * messages, **fields}).encode()


def test_a_worker_answers_the_body_and_its_prompt_as_the_server_would(model):
    processes = ChatProcesses(model, 1)
    content = chat(3000, max_tokens=5)
    assert processes.takes(len(content)) and not processes.takes(PROCESS_BYTES)
    try:
        body, text = asyncio.run(processes.prepare(content))
        whole = ChatBody.model_validate_json(content)
        assert text == render_chat(load_tokenizer(model), whole)
        assert body.messages == [] and body.max_tokens == 5
        with pytest.raises(RequestValidationError) as invalid:
            asyncio.run(processes.prepare(chat(3000, temperature="hot")))
        assert invalid.value.errors()[0]["loc"] == ("body", "temperature")
        with pytest.raises(APIError) as unsupported:
            asyncio.run(processes.prepare(chat(3000, audio={"voice": "x"})))
        assert unsupported.value.status_code == 400 and unsupported.value.param == "audio"
        assert processes.prepared == 3
        [worker] = processes._workers
    finally:
        processes.close()
    assert worker.process.poll() is not None  # closed with the server


def test_bodies_sent_at_once_are_prepared_by_the_configured_number_of_workers(model):
    processes = ChatProcesses(model, 2)

    async def many() -> list:
        return await asyncio.gather(*(processes.prepare(chat(3000, max_tokens=n + 1)) for n in range(6)))

    try:
        answers = asyncio.run(many())
        assert [body.max_tokens for body, _ in answers] == [1, 2, 3, 4, 5, 6]
        assert len(processes._workers) == 2
        assert len({worker.process.pid for worker in processes._workers}) == 2
    finally:
        processes.close()


def test_a_body_whose_client_left_is_stopped_and_the_next_one_is_served(model):
    processes = ChatProcesses(model, 1)  # one worker: the next body waits unless the first one stops

    async def leave_then_ask() -> str:
        await processes.prepare(chat(3000))  # the worker is up
        huge = asyncio.create_task(processes.prepare(chat(400_000)))  # 10 MB: seconds to validate and render
        await asyncio.sleep(0.5)
        huge.cancel()
        _, text = await processes.prepare(chat(3000, max_tokens=2))
        return text

    try:
        text = asyncio.run(leave_then_ask())
        assert text and processes.stopped == 1
        assert processes.stopped_in_workers == 1  # the worker stopped it: the next body did not wait for it
    finally:
        processes.close()


def test_a_worker_that_dies_fails_its_body_with_a_500_and_is_started_again(model):
    processes = ChatProcesses(model, 1)

    async def kill_mid_body() -> None:
        await processes.prepare(chat(3000))
        [worker] = processes._workers
        huge = asyncio.create_task(processes.prepare(chat(400_000)))
        await asyncio.sleep(0.5)
        os.kill(worker.process.pid, signal.SIGKILL)
        with pytest.raises(APIError) as died:
            await huge
        assert died.value.status_code == 500 and "exited with code -9" in str(died.value.detail)
        body, text = await processes.prepare(chat(3000))  # a new worker
        assert text and processes._workers[0] is not worker

    try:
        asyncio.run(kill_mid_body())
    finally:
        processes.close()
