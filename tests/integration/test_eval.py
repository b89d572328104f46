"""`asyncrl eval` against a real `asyncrl inference` process on loopback, over both routes, and online evals
during a short `asyncrl rl` run."""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from servers import free_port, inference_command, running_server  # tests/integration, on sys.path under pytest

from asyncrl.environments import load_environment
from asyncrl.evals.metrics import pass_at_k
from asyncrl.metrics import read_jsonl
from asyncrl.models.offline import init_model

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
N = 4  # samples per example
EVAL_TOML = """
samples_per_example = 4
pass_at = [1, 2, 4]
sampling = {{ temperature = 1.0, max_tokens = 6 }}

[model]
name = "{model}"

[environments.short]
name = "reverse_text"
args = {{ min_length = 2, max_length = 4 }}
num_examples = 3
pass_threshold = 0.2

[environments.two_turns]
name = "eval_envs:TwoTurns"
num_examples = 2
pass_threshold = 0.5
"""


def asyncrl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))  # eval_envs.py
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-m", "asyncrl", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eval") / "tiny"
    init_model(path, "tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    port = free_port()
    command = inference_command(model, port, "--seq-len", "256")
    with running_server(command, port, tmp_path_factory.mktemp("logs") / "inference.log", timeout=90) as url:
        yield url


def run_eval(model: Path, url: str, output_dir: Path, *flags: str) -> tuple[list[dict], dict]:
    config = output_dir.parent / f"{output_dir.name}.toml"
    config.write_text(EVAL_TOML.format(model=model))
    result = asyncrl("eval", "@", str(config), "--inference-url", url, "--output-dir", str(output_dir), *flags)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "avg@4" in result.stdout and "two_turns" in result.stdout  # the summary table
    return read_jsonl(output_dir / "results.jsonl"), json.loads((output_dir / "summary.json").read_text())


def check_results_match_summary(results: list[dict], summary: dict) -> None:
    """One line per rollout, n per example, and a summary that is exactly the formulas over those lines."""
    assert len(results) == 3 * N + 2 * N
    for label, examples in (("short", 3), ("two_turns", 2)):
        lines = [r for r in results if r["env"] == label]
        assert sorted((r["example"], r["sample"]) for r in lines) == list(itertools.product(range(examples), range(N)))
        s = summary["environments"][label]
        assert (s["examples"], s["rollouts"], s["errored"]) == (examples, examples * N, 0)
        assert s["avg@4"] == pytest.approx(statistics.fmean(r["reward"] for r in lines))
        for k in (1, 2, 4):
            passing = [sum(r["passed"] for r in lines if r["example"] == i) for i in range(examples)]
            assert s[f"pass@{k}"] == pytest.approx(statistics.fmean(pass_at_k(N, c, k) for c in passing))
    for r in results:  # the whole conversation: the prompt, every answer, every environment message
        roles = ["user", "assistant", "user", "assistant"] if r["env"] == "two_turns" else ["user", "assistant"]
        assert [m["role"] for m in r["messages"]] == roles
        assert r["messages"][-1]["content"] == r["completion"] and r["messages"][0]["content"] == r["prompt"]
    assert all(r["turns"] == 2 and r["messages"][2]["content"] == "again" for r in results if r["env"] == "two_turns")


def test_eval_over_the_token_route(model, server, tmp_path):
    results, summary = run_eval(model, server, tmp_path / "eval")
    assert summary["api"] == "generate"  # auto: our server has /v1/generate
    assert summary["pass_at"] == [1, 2, 4]
    check_results_match_summary(results, summary)
    assert all(r["policy_version"] == 0 and 1 <= r["completion_tokens"] for r in results)
    # Held-out: the prompts are the environment's eval stream, not the training stream of a small seed.
    env = load_environment("reverse_text", min_length=2, max_length=4)
    held_out = [e.prompt[-1]["content"] for e in itertools.islice(env.eval_examples(), 3)]
    assert [r["prompt"] for r in results if r["env"] == "short" and r["sample"] == 0] == held_out
    assert held_out != [e.prompt[-1]["content"] for e in itertools.islice(env.examples(0), 3)]


def test_eval_over_the_chat_route(model, server, tmp_path):
    results, summary = run_eval(model, server, tmp_path / "eval", "--api", "chat")
    assert summary["api"] == "chat"
    check_results_match_summary(results, summary)
    assert all(r["completion_tokens"] is None for r in results)


def test_eval_of_a_model_folder_starts_and_stops_its_own_server(model, tmp_path):
    config = tmp_path / "eval.toml"
    config.write_text(EVAL_TOML.format(model=model))
    output_dir = tmp_path / "eval"
    result = asyncrl("eval", "@", str(config), "--output-dir", str(output_dir), "--server.seq-len", "256",
                     "--server.num-threads", "1")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["api"] == "generate" and summary["inference_url"] is None
    check_results_match_summary(read_jsonl(output_dir / "results.jsonl"), summary)
    url = result.stdout.split(" on ", 1)[1].split()[0]
    assert url.startswith("http://127.0.0.1:") and f"serving {model}" in (output_dir / "inference.log").read_text()
    with pytest.raises(httpx.TransportError):  # stopped with the eval
        httpx.get(f"{url}/health", timeout=2)


def test_unreachable_server_is_one_clear_error(model, tmp_path):
    config = tmp_path / "eval.toml"
    config.write_text(EVAL_TOML.format(model=model))
    result = asyncrl("eval", "@", str(config), "--inference-url", f"http://127.0.0.1:{free_port()}",
                     "--wait-timeout", "1", "--output-dir", str(tmp_path / "eval"))  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "did not answer on /v1/models" in result.stderr


ONLINE_RL_TOML = """
output_dir = "{output_dir}"
seq_len = 128
max_steps = 3

[model]
name = "{model}"

[deployment]
inference_threads = 1
trainer_threads = 1

[inference]
port = 0

[orchestrator]
batch_size = 8
group_size = 4
sampling = {{ temperature = 1.0, max_tokens = 6 }}
environments.reverse_text.args = {{ min_length = 2, max_length = 4 }}

[orchestrator.eval]
interval = 2
samples_per_example = 2
environments.held_out = {{ name = "reverse_text", args = {{ min_length = 2, max_length = 4 }}, num_examples = 3 }}
"""


def test_online_evals_are_logged_every_interval_steps(model, tmp_path):
    config = tmp_path / "rl.toml"
    config.write_text(ONLINE_RL_TOML.format(model=model, output_dir=tmp_path / "run"))
    result = asyncrl("rl", "@", str(config), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["source"] == "orchestrator"]
    evals = {r["step"]: r for r in lines if "eval/time" in r}
    assert sorted(evals) == [1, 3]  # steps 1, 1 + interval
    assert evals[1]["eval/policy_version"] == 0  # the first eval measures the starting policy
    for record in evals.values():
        assert 0.0 <= record["eval/held_out/avg@2"] <= 1.0
        assert 0.0 <= record["eval/held_out/pass@1"] <= record["eval/held_out/pass@2"] <= 1.0
        assert record["eval/held_out/errored"] == 0
    # Training lines are unchanged: one per step, after that step's eval line.
    training = [r for r in lines if "reward/mean" in r]
    assert [r["step"] for r in training] == [1, 2, 3]
    assert all("eval/time" not in r for r in training)
    assert lines.index(evals[3]) < lines.index(training[2])
