"""The verifiers adapter against a real `asyncrl inference` process: episodes of the small verifiers
environment in verifiers_env/ become trajectories whose tokens, loss masks and logprobs are exactly what
the server sampled. Opt-in (`pytest -m verifiers`), in a virtual environment with `asyncrl[verifiers]`."""

from __future__ import annotations

import asyncio
import difflib
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1", reason="needs verifiers 0.4: pip install 'asyncrl[verifiers]' (its own venv)")

import torch  # noqa: E402
from servers import free_port, inference_command, running_server  # noqa: E402  (tests/integration)
from transformers import AutoModelForCausalLM  # noqa: E402

from asyncrl.config.schema import SamplingConfig  # noqa: E402
from asyncrl.environments import load_environment  # noqa: E402
from asyncrl.loading import load_tokenizer  # noqa: E402
from asyncrl.models.offline import init_model  # noqa: E402
from asyncrl.orchestrator.client import InferenceClient, ServedPolicy  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.verifiers]

VERIFIERS_ENV = Path(__file__).resolve().parent / "verifiers_env"  # holds the `vf-reverse-text` taskset
GROUP = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("verifiers") / "tiny"
    init_model(path, "tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    port = free_port()
    command = inference_command(model, port, "--seq-len", "256")
    with running_server(command, port, tmp_path_factory.mktemp("logs") / "inference.log") as url:
        yield url


@pytest.fixture
def environment(monkeypatch):
    monkeypatch.syspath_prepend(str(VERIFIERS_ENV))
    return load_environment("verifiers", taskset="vf-reverse-text", config={"taskset": {"num_tasks": 6}}, held_out=2)


def play(url: str, model: Path, environment, example):
    async def group():
        client = InferenceClient(url, None, request_timeout=300)
        try:
            policy = ServedPolicy(client, load_tokenizer(str(model)), SamplingConfig(max_tokens=8), seq_len=256)
            return await environment.rollout_group(example, policy, GROUP)
        finally:
            await client.close()

    return asyncio.run(group())


def test_held_out_tasks_are_the_eval_examples_and_never_trained_on(environment):
    train = [e.prompt[-1]["content"] for e in itertools.islice(environment.examples(0), 12)]
    held_out = [e.prompt[-1]["content"] for e in environment.eval_examples()]
    assert len(held_out) == 2 and len(set(train)) == 4
    assert not set(train) & set(held_out)


def test_episodes_become_trajectories_of_exactly_the_sampled_tokens(server, model, environment):
    example = next(environment.examples(0))
    start = time.monotonic()
    rollouts = play(server, model, environment, example)
    print(f"{GROUP} verifiers episodes in {time.monotonic() - start:.1f}s")
    tokenizer = load_tokenizer(str(model))
    prompt_ids = tokenizer.apply_chat_template(example.prompt, add_generation_prompt=True, return_dict=False)
    reference = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    assert len(rollouts) == GROUP
    for rollout in rollouts:
        assert rollout.error is None, rollout.error
        [sample] = rollout.samples
        assert len(sample.input_ids) == len(sample.loss_mask) == len(sample.inference_logprobs)
        # The prompt as our chat template renders it, outside the loss; then the sampled tokens, in it.
        assert sample.input_ids[: len(prompt_ids)] == prompt_ids
        assert sample.loss_mask == [False] * len(prompt_ids) + [True] * (len(sample.input_ids) - len(prompt_ids))
        sampled = sample.input_ids[len(prompt_ids) :]
        assert 1 <= len(sampled) <= 8
        assert sample.inference_logprobs[: len(prompt_ids)] == [0.0] * len(prompt_ids)
        # The logprobs are the server's, of these very tokens: teacher forcing the same weights agrees.
        with torch.no_grad():
            logits = reference(torch.tensor([sample.input_ids])).logits[0, len(prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(sampled)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(sample.inference_logprobs[len(prompt_ids) :]), expected, atol=1e-4)
        # The reward is the verifiers task's own, on the text the model produced.
        assert rollout.completion_text == tokenizer.decode(sampled, skip_special_tokens=True).strip()
        similarity = difflib.SequenceMatcher(None, rollout.completion_text, example.answer).ratio()
        assert rollout.reward == pytest.approx(similarity)
        assert rollout.metrics["exact_match"] == float(rollout.completion_text == example.answer)
        assert rollout.policy_versions == [0] * len(sampled)


def test_asyncrl_eval_runs_a_verifiers_environment(server, model, tmp_path):
    config = tmp_path / "eval.toml"
    config.write_text(
        f'model.name = "{model}"\nsamples_per_example = 2\nsampling = {{ max_tokens = 8 }}\n'
        '[environments.reverse]\nname = "verifiers"\nnum_examples = 2\n'
        'args = { taskset = "vf-reverse-text", held_out = 2, config = { taskset = { num_tasks = 6 } } }\n'
    )
    path = os.pathsep.join(filter(None, [str(VERIFIERS_ENV), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-m", "asyncrl", "eval", "@", str(config), "--inference-url", server,
         "--output-dir", str(tmp_path / "eval")],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["api"] == "generate"
    assert summary["environments"]["reverse"]["rollouts"] == 4
    assert summary["environments"]["reverse"]["errored"] == 0
