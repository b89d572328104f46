"""verifiers environments in asyncrl: `name = "verifiers"`, `args = { taskset = "<taskset id>" }`.

verifiers 0.4 (the `verifiers.v1` API; `pip install 'asyncrl[verifiers]'`, which needs `openai<3`) plays
an episode its own way: a harness program, run in a subprocess by `uv`, talks to the model through
verifiers' interception server, whose train client renders the chat template itself and calls our
server's `/inference/v1/generate`. So every sampled token id and its logprob come back as they were
sampled, and each episode's trace becomes our trajectory without re-tokenizing anything:

- one token sample per trainable branch of the trace's message graph: `input_ids` = the branch's tokens,
  `loss_mask` = its sampled tokens, `inference_logprobs` = their logprobs (0 elsewhere);
- reward = the sum of the trace's weighted rewards (`trace.reward`), metrics = its unweighted metrics;
- a failed episode, or a reward that did not run, is an errored rollout (counted, left out of training);
- policy versions: the version the server held when the group started, for every sampled token — verifiers
  does not carry ours through, and the oldest possible version keeps the off-policy bound safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

from asyncrl.environments.base import Environment, Example, Policy, Rollout, TokenSample, all_or_none
from asyncrl.environments.rubric import Rubric
from asyncrl.errors import AsyncRLError

HEALTH_TIMEOUT = 30.0  # seconds to read the served policy version before a group


def _verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise AsyncRLError(
            f"environment 'verifiers' needs the verifiers package ({e}): pip install 'asyncrl[verifiers]', "
            "in a virtual environment of its own (it needs openai<3)"
        ) from None
    return vf


def _deep_merge(base: dict, layer: dict) -> dict:
    merged = dict(base)
    for key, value in layer.items():
        merged[key] = _deep_merge(merged[key], value) if isinstance(value, dict) and key in merged else value
    return merged


class VerifiersEnvironment(Environment):
    """A verifiers taskset played by a verifiers environment (the taskset's own, else its single-agent
    one), as an asyncrl environment.

    `taskset`: the installed taskset package's id. `config`: more of verifiers' env config, deep-merged
    (e.g. `{ taskset = { num_tasks = 64 }, agent = { max_turns = 4 } }`); the default agent is verifiers'
    `null` harness (a plain chat loop) in the local `subprocess` runtime. `held_out`: the last tasks of
    the taskset, kept out of training and served as the eval examples (0: evals see every task).
    `timeout`: seconds one episode may take.
    """

    name = "verifiers"

    def __init__(self, taskset: str, config: dict | None = None, held_out: int = 0, timeout: float = 600.0):
        super().__init__()
        vf = _verifiers()
        defaults = {"taskset": {"id": taskset}, "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}
        try:
            self.env = vf.load_environment(vf.resolve_env_config(_deep_merge(defaults, config or {})))
            tasks = list(self.env.taskset)
        except Exception as e:  # noqa: BLE001 - verifiers' loaders raise many types; the user fixes the config
            raise AsyncRLError(f"verifiers environment '{taskset}' could not be loaded: {e}") from None
        if not 0 <= held_out < len(tasks):
            raise AsyncRLError(f"held_out = {held_out}, but taskset '{taskset}' has {len(tasks)} tasks")
        self.train_tasks = tasks[: len(tasks) - held_out]
        self.eval_tasks = tasks[len(tasks) - held_out :] if held_out else tasks
        self.timeout = timeout
        self.rubric = Rubric(rewards=[])  # verifiers tasks score themselves (`@vf.reward`)
        self._serving_users = 0
        self._serving: contextlib.AsyncExitStack | None = None
        self._serving_lock = asyncio.Lock()

    def examples(self, seed: int) -> Iterator[Example]:
        """The training tasks, reshuffled each epoch."""
        rng = random.Random(seed)
        while True:
            for task in rng.sample(self.train_tasks, len(self.train_tasks)):
                yield self._example(task)

    def eval_examples(self) -> Iterator[Example]:
        return (self._example(task) for task in self.eval_tasks)

    def _example(self, task: Any) -> Example:
        prompt = task.data.prompt
        messages = (
            [{"role": "user", "content": prompt}]
            if isinstance(prompt, str)
            else [{"role": m.role, "content": m.content} for m in prompt or []]
        )
        if task.data.system_prompt:
            messages.insert(0, {"role": "system", "content": task.data.system_prompt})
        return Example(prompt=messages, answer=str(getattr(task.data, "answer", "")), info={"task": task})

    @contextlib.asynccontextmanager
    async def _episodes(self) -> AsyncIterator[None]:
        """verifiers' serving resources (its interception server), shared by every group in flight: they
        live on the verifiers env object, so two concurrent `serving()` blocks would undo each other."""
        async with self._serving_lock:
            if self._serving_users == 0:
                self._serving = contextlib.AsyncExitStack()
                await self._serving.enter_async_context(self.env.serving())
            self._serving_users += 1
        try:
            yield
        finally:
            async with self._serving_lock:
                self._serving_users -= 1
                if self._serving_users == 0:
                    await self._serving.aclose()

    async def rollout_group(self, example: Example, policy: Policy, group_size: int) -> list[Rollout]:
        vf = _verifiers()
        client = getattr(policy, "client", None)
        if client is None or not hasattr(client, "url"):
            raise AsyncRLError("environment 'verifiers' needs the served policy of an asyncrl inference server")
        version = (await client.wait_ready(HEALTH_TIMEOUT))["policy_version"]
        model = policy.tokenizer.name_or_path
        context = vf.ModelContext(
            model=model,
            client=vf.TrainClientConfig(base_url=f"{client.url}/v1", renderer_model_name=model),
            sampling=vf.SamplingConfig(
                temperature=policy.temperature, top_p=policy.sampling.top_p, max_tokens=policy.max_tokens
            ),
        )
        task = example.info["task"]
        async with self._episodes():
            episodes = await all_or_none(self._episode(task, context) for _ in range(group_size))
        return [self._rollout(example, episode, version) for episode in episodes]

    async def _episode(self, task: Any, context: Any) -> Any:
        try:
            async with asyncio.timeout(self.timeout):
                return await self.env.run_episode(task, context)
        except TimeoutError:
            return f"episode timed out after {self.timeout:.0f}s"

    def _rollout(self, example: Example, episode: Any, version: int) -> Rollout:
        """One episode as one rollout (see the module docstring)."""
        if isinstance(episode, str):
            return Rollout(example, [], list(example.prompt), [], "", "", error=episode)
        traces = [t for t in episode.traces if t.agent.trainable]
        samples = [
            TokenSample(list(b.token_ids), list(b.sampled_mask), list(b.logprobs))
            for t in traces
            for b in t.branches
            if b.trainable
        ]
        error = None
        if not episode.ok:
            last = episode.last_error or next((t.last_error for t in traces if t.last_error), None)
            error = f"verifiers episode failed: {last.type}: {last.message}" if last else "verifiers episode failed"
        elif any(r is None for t in traces for r in t.rewards.values()):
            error = "a verifiers reward did not run"
        elif not any(sum(s.loss_mask) for s in samples):
            error = "the verifiers episode sampled no tokens"
        from verifiers.v1.dialects.chat import message_to_wire

        last_trace = traces[-1] if traces else None
        return Rollout(
            example=example,
            samples=samples,
            messages=[message_to_wire(m) for m in last_trace.messages] if last_trace else list(example.prompt),
            policy_versions=[version] * sum(sum(s.loss_mask) for s in samples),
            completion_text=last_trace.last_reply if last_trace else "",
            finish_reason="length" if any(t.is_truncated for t in traces) else "stop",
            turns=sum(t.num_turns for t in traces),
            is_truncated=any(t.is_truncated for t in traces),
            reward=sum(t.reward for t in traces),
            metrics={k: v for t in traces for k, v in t.metrics.items() if v is not None},
            error=error,
        )
