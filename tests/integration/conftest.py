"""Fixtures shared by the integration tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from rl_runs import run_rl
from scored_rollouts import scored_group
from servers import free_port, inference_command, running_server

from asyncrl.loading import load_tokenizer
from asyncrl.metrics import JsonlWriter
from asyncrl.models.offline import init_model
from asyncrl.orchestrator.sample_log import sample_record

RL_EVAL = ("--orchestrator.eval.interval", "2", "--orchestrator.eval.environments.reverse_text.num_examples", "2")
TRACKED = ("--wandb.mode", "offline", "--wandb.project", "tests", "--tensorboard.enabled")


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Path:
    """A folder with two runs: `first`, 3 RL steps with online evals and offline W&B and TensorBoard trackers,
    and `second`, a copy of it to compare with. `first`'s samples.jsonl gets token-level lines made by the
    orchestrator's sample_log from real rollouts (reverse_text, and the multi-turn wordle) played against a
    real `asyncrl inference`."""
    root = tmp_path_factory.mktemp("dashboard")
    model = root / "tiny"
    init_model(model, "tiny", seed=0)
    result = run_rl(model, root / "runs" / "first", *RL_EVAL, *TRACKED)
    assert result.returncode == 0, result.stdout + result.stderr
    port = free_port()
    tokenizer = load_tokenizer(str(model))
    samples = JsonlWriter(root / "runs" / "first" / "samples.jsonl")
    with running_server(inference_command(model, port), port, root / "inference.log") as url:
        for env, args in (("reverse_text", {}), ("wordle", {"max_turns": 3})):
            for rollout, advantage in scored_group(url, model, env, group_size=2, max_tokens=8, **args)[:1]:
                samples.write(sample_record(3, env, rollout, advantage, tokenizer))
    shutil.copytree(root / "runs" / "first", root / "runs" / "second")
    return root / "runs"
