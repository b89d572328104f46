"""What `asyncrl rl` checks before it starts anything, so that a mistake costs seconds and one line instead
of a start-up and a traceback in a child's log:

- output_dir can be created and written;
- the model folder holds a model (a config.json that parses, weights, a tokenizer);
- every environment loads (its name, its module, its arguments), and its first prompts leave room for an
  answer within seq_len: none does is an error (the run would train nothing); some do not, answers cut
  short of `sampling.max_tokens`, or `max_tokens` longer than `seq_len` are warnings.

The devices asked for are checked where they are placed (placement.py). The orchestrator checks the prompt
lengths again when it starts by itself (`asyncrl orchestrator`).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config.schema import InferenceConfig, OrchestratorConfig, TrainerConfig
from asyncrl.environments import load_environment
from asyncrl.environments.base import Environment
from asyncrl.errors import AsyncRLError

PROMPTS_CHECKED = 64  # first examples of each environment's stream whose prompt lengths are checked


def check_output_dir(output_dir: Path) -> None:
    """Create the run folder (and its parents); fail with one line when it cannot be created or written."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise AsyncRLError(
            f"output_dir '{output_dir}' cannot be created: {error.strerror or error} (set output_dir to a folder "
            "you can write)"
        ) from None
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise AsyncRLError(f"output_dir '{output_dir}' is not writable (set output_dir to a folder you can write)")


def cpu_oversubscription(
    replicas: list[InferenceConfig], trainer: TrainerConfig, trainer_ranks: int, cores: int
) -> str | None:
    """A warning when the processes that compute on the CPU outnumber its usable cores: each then gets less than
    a core, and a step takes many times longer than on fewer processes."""
    on_cpu = sum(r.device == "cpu" for r in replicas) + (trainer_ranks if trainer.device == "cpu" else 0)
    if on_cpu <= cores:
        return None
    return (
        f"{trainer_ranks if trainer.device == 'cpu' else 0} trainer rank(s) and "
        f"{sum(r.device == 'cpu' for r in replicas)} inference server(s) compute on the CPU, which has {cores} usable "
        "core(s): each gets less than one, and steps will be slow (lower deployment.trainer_ranks or "
        "deployment.inference_replicas)"
    )


@dataclass
class PromptLengths:
    """The token lengths of an environment's first prompts, against the room one sample has."""

    label: str
    lengths: list[int]
    room: int  # tokens of one sample: seq_len, or the environment's own max_tokens if smaller
    max_tokens: int  # sampling.max_tokens

    def problems(self, seq_len: int) -> tuple[str | None, list[str]]:
        """An error (no prompt leaves room for an answer), and warnings."""
        if not self.lengths:
            return None, []
        bound = f"seq_len = {seq_len}" if self.room == seq_len else f"its max_tokens = {self.room}"
        longest, count = max(self.lengths), len(self.lengths)
        no_room = sum(length >= self.room for length in self.lengths)
        cut = sum(length + self.max_tokens > self.room for length in self.lengths) - no_room
        what = f"the first {count} prompts of environment '{self.label}' are {min(self.lengths)}-{longest} tokens"
        if no_room == count:
            return (
                f"{what}: none leaves room for an answer within {bound}, so the run would train nothing "
                f"(raise seq_len to at least {longest + self.max_tokens})"
            ), []
        warnings = []
        if no_room:
            warnings.append(
                f"{what}: {no_room} leave no room for an answer within {bound}; their rollouts are cut before "
                "answering and train nothing"
            )
        if cut:
            warnings.append(
                f"{what}: answers to {cut} of them are cut at {bound} before sampling.max_tokens = {self.max_tokens}"
            )
        return None, warnings


def prompt_lengths(label: str, env: Environment, tokenizer, cfg: OrchestratorConfig) -> PromptLengths:
    """Render the environment's first prompts as the episode does (chat template, its tools, the generation
    prompt) and count their tokens. Examples without chat messages are left out: their environment builds
    its own prompt (its own `rollout_group`, token ids in `info`)."""
    examples = itertools.islice(env.examples(cfg.seed), PROMPTS_CHECKED)
    lengths = [
        len(
            tokenizer.apply_chat_template(
                example.prompt, tools=env.tools, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for example in examples
        if example.prompt
    ]
    room = min(cfg.seq_len, env.limits.max_tokens or cfg.seq_len)
    return PromptLengths(label, lengths, room, cfg.sampling.max_tokens)


def check_prompt_lengths(environments: dict[str, Environment], tokenizer, cfg: OrchestratorConfig) -> list[str]:
    """Raise AsyncRLError when an environment's prompts leave no room for an answer; returns the warnings."""
    warnings = []
    if cfg.sampling.max_tokens > cfg.seq_len:
        warnings.append(
            f"orchestrator.sampling.max_tokens = {cfg.sampling.max_tokens} exceeds seq_len = {cfg.seq_len}: no "
            "prompt and answer can be that long; answers are cut at seq_len"
        )
    for label, env in environments.items():
        error, found = prompt_lengths(label, env, tokenizer, cfg).problems(cfg.seq_len)  # none without chat prompts
        if error:
            raise AsyncRLError(error)
        warnings += found
    return warnings


def online_eval_environments(cfg: OrchestratorConfig) -> dict[str, Environment]:
    """The held-out environments of the run's online evals, built here so that an unknown name or bad args
    stop the run before any process starts (none when evals are off)."""
    from asyncrl.evals.online import online_eval_environments as configs
    from asyncrl.evals.run import load_eval_environments

    return load_eval_environments(configs(cfg)) if cfg.eval.interval else {}


def local_environments(cfg: OrchestratorConfig) -> dict[str, Environment]:
    """The run's environments that can be built here: in-process ones and those of a local env-server (an
    env-server elsewhere has its own code and data)."""
    return {
        label: load_environment(env.name or label, **env.args)
        for label, env in cfg.environments.items()
        if env.env_server in (None, "local")
    }
