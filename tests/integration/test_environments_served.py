"""The built-in environments playing real episodes against `asyncrl inference` on a tiny (untrained) model.

An untrained model answers garbage, so these tests check the mechanics, not learning: every turn's prompt is
exactly what was sent before plus the tokens sampled and the environment's tokens, sampled tokens keep
their logprobs and are the only ones in the loss, limits truncate without losing the rollout, and rewards
are computed.
"""

from __future__ import annotations

import asyncio

import pytest
from servers import free_port, inference_command, running_server  # tests/integration, on sys.path under pytest

from asyncrl.config.schema import OrchestratorConfig, SamplingConfig
from asyncrl.environments import load_environment
from asyncrl.environments.base import Completion, Rollout
from asyncrl.loading import load_tokenizer
from asyncrl.models.offline import init_model
from asyncrl.orchestrator.batch import BatchCutter, batch_metrics
from asyncrl.orchestrator.client import InferenceClient, ServedPolicy
from asyncrl.orchestrator.dispatcher import Dispatcher
from asyncrl.orchestrator.loop import load_environments, next_batch
from asyncrl.orchestrator.notify import Notifier
from asyncrl.orchestrator.pool import InferencePool
from asyncrl.orchestrator.queue import RolloutQueue
from asyncrl.orchestrator.sampler import EnvironmentSampler

pytestmark = pytest.mark.integration

SEQ_LEN = 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("envs") / "tiny"
    init_model(path, "tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = free_port()
    command = inference_command(model_dir, port, "--seq-len", str(SEQ_LEN))
    with running_server(command, port, tmp_path_factory.mktemp("logs") / "inference.log") as url:
        yield url


class RecordingPolicy(ServedPolicy):
    """The served policy, keeping every prompt it was sent and what came back."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: dict[tuple[int, ...], list[Completion]] = {}

    async def generate(self, prompt_ids, n, max_tokens=None, seed=None):
        completions = await super().generate(prompt_ids, n, max_tokens, seed)
        self.calls.setdefault(tuple(prompt_ids), []).extend(completions)
        return completions


def play(server, model_dir, env, group_size=3, examples=2, max_tokens=24, seq_len=SEQ_LEN):
    """Rollouts of the first `examples` examples, and the policy that recorded the requests."""

    async def main():
        client = InferenceClient(server, None, request_timeout=120)
        policy = RecordingPolicy(client, load_tokenizer(str(model_dir)), SamplingConfig(max_tokens=max_tokens), seq_len)
        try:
            stream = env.examples(seed=0)
            groups = [await env.rollout_group(next(stream), policy.seeded(i), group_size) for i in range(examples)]
        finally:
            await client.close()
        return [r for g in groups for r in g], policy

    return asyncio.run(main())


def sampled_runs(mask: list[bool]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def check_token_in_token_out(rollout: Rollout, policy: RecordingPolicy, env) -> None:
    """Every run of loss tokens is one turn: the tokens before it are exactly a prompt that was sent, and
    the run is exactly what the server sampled for it, with its logprobs; nothing else is in the loss."""
    first_prompt = policy.tokenizer.apply_chat_template(
        rollout.example.prompt, tools=env.tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert rollout.samples[0].input_ids[: len(first_prompt)] == first_prompt
    turns = 0
    for sample in rollout.samples:
        assert len(sample.input_ids) == len(sample.loss_mask) == len(sample.inference_logprobs)
        assert all(lp == 0.0 for lp, m in zip(sample.inference_logprobs, sample.loss_mask) if not m)
        for start, end in sampled_runs(sample.loss_mask):
            sent = tuple(sample.input_ids[:start])
            assert sent in policy.calls, "a turn's prompt is not what the server was sent"
            sampled = [(c.token_ids, c.logprobs) for c in policy.calls[sent]]
            assert (sample.input_ids[start:end], sample.inference_logprobs[start:end]) in sampled
            turns += 1
    assert turns == rollout.turns


@pytest.mark.parametrize("name", ["reverse_text", "arithmetic", "wordle", "tool_calc"])
def test_builtin_environment_plays_real_token_in_token_out_rollouts(server, model_dir, name):
    env = load_environment(name)
    rollouts, policy = play(server, model_dir, env)
    assert len(rollouts) == 6
    for rollout in rollouts:
        check_token_in_token_out(rollout, policy, env)
        assert rollout.error is None
        assert set(rollout.metrics) == {fn.__name__ for fn, _ in env.rubric.rewards} | {
            fn.__name__ for fn in env.rubric.metrics
        }
        assert rollout.reward == pytest.approx(sum(w * rollout.metrics[fn.__name__] for fn, w in env.rubric.rewards))
        assert 1 <= rollout.turns <= env.limits.max_turns
        assert sum(len(s.input_ids) for s in rollout.samples) <= SEQ_LEN


def test_wordle_feedback_is_in_the_trajectory_and_out_of_the_loss(server, model_dir):
    env = load_environment("wordle")
    rollouts, policy = play(server, model_dir, env, group_size=2, examples=1)
    multi_turn = [r for r in rollouts if r.turns > 1]
    assert multi_turn, "garbage guesses should keep the game going"
    for rollout in multi_turn:
        sample = rollout.samples[-1]
        environment_text = policy.tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if not m])
        feedback = [m["content"] for m in rollout.messages if m["role"] == "user"][1:]
        assert len(feedback) == rollout.turns - 1 or rollout.is_truncated
        assert all(f in environment_text for f in feedback)
        assert rollout.metrics["guesses"] == rollout.turns


def test_token_and_turn_limits_truncate_but_keep_the_rollout(server, model_dir):
    rollouts, _ = play(server, model_dir, load_environment("wordle", max_tokens=200), group_size=2, examples=1)
    assert all(r.is_truncated and r.error is None for r in rollouts)
    assert all(len(s.input_ids) <= 200 for r in rollouts for s in r.samples)

    rollouts, _ = play(server, model_dir, load_environment("wordle", max_turns=2), group_size=2, examples=1)
    assert [r.turns for r in rollouts] == [2, 2]
    assert all(r.is_truncated for r in rollouts)


def test_time_limit_truncates_but_keeps_the_rollout(server, model_dir):
    env = load_environment("wordle", time_limit=0.0)
    rollouts, policy = play(server, model_dir, env, group_size=2, examples=1)
    assert len(rollouts) == 2 and policy.calls == {}
    assert all(r.is_truncated and r.turns == 0 and r.error is None for r in rollouts)


def test_a_batch_mixes_environments_by_weight_with_metrics_per_environment(server, model_dir):
    """The orchestrator's own dispatch and batch cut, against the real server: lockstep, so batch 1 is exactly
    the first six groups drawn."""
    cfg = OrchestratorConfig(
        inference_urls=[server],
        batch_size=12,
        group_size=2,
        max_async_level=0,
        seq_len=SEQ_LEN,
        sampling=SamplingConfig(max_tokens=16),
        environments={"arithmetic": {"weight": 2.0, "advantage": {"estimator": "rloo"}}, "wordle": {"args": {}}},
    )
    environments = load_environments(cfg)
    sampler = EnvironmentSampler(environments, {k: e.weight for k, e in cfg.environments.items()}, cfg.seed)

    async def main():
        notifier = Notifier()
        pool = InferencePool(cfg.inference_urls, None, 120, 30, notifier)
        tokenizer = load_tokenizer(str(model_dir))
        policies = {s.index: ServedPolicy(s.client, tokenizer, cfg.sampling, cfg.seq_len) for s in pool.servers}
        dispatcher = Dispatcher(cfg, pool, environments, sampler, lambda s: policies[s.index], RolloutQueue(), notifier)
        task = asyncio.create_task(dispatcher.run())
        try:
            cutter = BatchCutter(cfg.batch_size, cfg.batch_tokens, cfg.max_async_level)
            return await next_batch(1, cutter, dispatcher, [task], timeout=120)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await pool.close()

    batch = asyncio.run(main())
    labels = [g.label for g in batch.groups]
    assert labels.count("arithmetic") == 4 and labels.count("wordle") == 2
    assert [g.index for g in batch.groups] == list(range(6))
    metrics = batch_metrics(batch, 0)
    for label in ("arithmetic", "wordle"):
        assert f"reward/{label}/mean" in metrics and f"rollouts/{label}/truncated" in metrics
    assert metrics["turns/wordle/mean"] > 1
    assert "reward/wordle/best_greens" in metrics and "reward/arithmetic/correct" in metrics
    samples = batch.samples(cfg.sampling.temperature)
    flat = sum(not g.carries_signal for g in batch.groups)
    assert len(samples) == sum(len(r.samples) for r in batch.rollouts if r.error is None) - 2 * flat
