"""Every metric name a run logs to metrics.jsonl, with its unit and meaning.

The dashboard, `asyncrl plot`, the trackers and docs/metrics.md all read this one list, so a name is
documented once. Names hold placeholders for the parts a run chooses: `<label>` (an environment's key in
the config), `<name>` (a reward function or rubric metric), `<n>` and `<k>` (avg@n, pass@k).

    python -m asyncrl.metric_names > docs/metrics.md
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str  # with placeholders, e.g. "reward/<label>/mean"
    source: str  # the `source` field of its metrics.jsonl lines
    unit: str
    meaning: str

    @functools.cached_property
    def pattern(self) -> re.Pattern:
        parts = re.split(r"(<[a-z]+>)", self.name)
        regex = "".join("[^/]+" if p.startswith("<") else re.escape(p) for p in parts)
        return re.compile(f"^{regex}$")


ORCH, T, S = "orchestrator", "trainer", "sft"
BATCH = "one line per trainer step, for the batch of that step"

# More specific names come before the general ones they overlap (reward/<label>/mean before reward/<label>/<name>).
METRICS: list[Metric] = [
    # orchestrator: the batch
    Metric("reward/mean", ORCH, "reward", "mean reward of the batch's scored rollouts (errored ones left out)"),
    Metric("reward/std", ORCH, "reward", "population standard deviation of those rewards"),
    Metric("reward/<label>/mean", ORCH, "reward", "reward/mean over the rollouts of one environment"),
    Metric("reward/<label>/std", ORCH, "reward", "reward/std over the rollouts of one environment"),
    Metric("reward/<label>/<name>", ORCH, "the function's value", "mean of one reward function or rubric metric"),
    Metric(
        "rollouts/errored", ORCH, "rollouts per batch", "rollouts whose reward or `respond` raised, hung or gave NaN"
    ),
    Metric("rollouts/truncated", ORCH, "rollouts per batch", "rollouts cut by a turn, token or time limit"),
    Metric(
        "rollouts/prefix_breaks",
        ORCH,
        "token samples per batch",
        "extra token samples started because a chat template re-rendered earlier turns",
    ),  # fmt: skip
    Metric("rollouts/<label>/errored", ORCH, "rollouts per batch", "rollouts/errored of one environment"),
    Metric("rollouts/<label>/truncated", ORCH, "rollouts per batch", "rollouts/truncated of one environment"),
    Metric(
        "rollouts/<label>/prefix_breaks", ORCH, "token samples per batch", "rollouts/prefix_breaks of one environment"
    ),
    Metric("turns/mean", ORCH, "assistant turns per rollout", "mean number of times the policy answered in an episode"),
    Metric("turns/<label>/mean", ORCH, "assistant turns per rollout", "turns/mean of one environment"),
    Metric(
        "seq_len/mean",
        ORCH,
        "tokens per rollout",
        "mean of prompt + sampled + environment tokens, summed over a rollout's token samples",
    ),  # fmt: skip
    Metric("completion_len/mean", ORCH, "tokens per rollout", "mean number of tokens the policy sampled in a rollout"),
    Metric(
        "off_policy/mean",
        ORCH,
        "policy versions",
        "mean over rollouts of (step - 1) - the oldest policy version among its tokens: how many trainer steps "
        "older than the trainer's weights the rollout is",
    ),  # fmt: skip
    Metric("off_policy/max", ORCH, "policy versions", "the largest such lag in the batch"),
    Metric(
        "off_policy/dropped",
        ORCH,
        "rollouts per batch",
        "rollouts left out because they were older than max_async_level allows",
    ),  # fmt: skip
    Metric(
        "batch/zero_advantage_groups",
        ORCH,
        "groups per batch",
        "groups left out because all their advantages were zero (no learning signal)",
    ),  # fmt: skip
    Metric("batch/samples", ORCH, "token samples per batch", "token samples sent to the trainer"),
    Metric("policy_version", ORCH, "policy version", "the version inference served while the batch was generated"),
    Metric(
        "perf/generate_tokens_per_s",
        ORCH,
        "tokens/s",
        "sampled tokens of the batch / seconds spent generating it (all groups together)",
    ),  # fmt: skip
    Metric("time/generate", ORCH, "seconds", "wall time to generate the batch"),
    Metric("time/wait_for_weights", ORCH, "seconds", "wall time waiting for the trainer to publish the needed version"),
    Metric("timestamp/generate_start", ORCH, "Unix time (s)", "when generation of the batch started"),
    Metric("timestamp/generate_end", ORCH, "Unix time (s)", "when generation of the batch ended"),
    # orchestrator: online evals (docs/evals.md), one line per eval before the batch line of its step
    Metric("eval/<label>/avg@<n>", ORCH, "reward", "mean reward of the n samples of each held-out example"),
    Metric("eval/<label>/pass@<k>", ORCH, "fraction of examples", "unbiased chance that one of k samples passes"),
    Metric("eval/<label>/errored", ORCH, "rollouts per eval", "eval rollouts whose reward or `respond` failed"),
    Metric("eval/<label>/truncated", ORCH, "rollouts per eval", "eval rollouts cut by a limit"),
    Metric("eval/<label>/mean/<name>", ORCH, "the function's value", "mean of one rubric value over the eval"),
    Metric("eval/policy_version", ORCH, "policy version", "the oldest policy version among the eval's tokens"),
    Metric("eval/time", ORCH, "seconds", "wall time of the eval"),
    # trainer
    Metric(
        "loss",
        T,
        "loss per loss token",
        "RL: the step's loss, a sum over all ranks' loss tokens divided by their count (docs/loss.md); "
        "SFT: mean -log p of the answer tokens (nats)",
    ),  # fmt: skip
    Metric("entropy", T, "nats per loss token", "mean entropy of the trainer's next-token distribution"),
    Metric(
        "mismatch_kl",
        T,
        "nats per loss token",
        "mean of exp(r) - r - 1, r = trainer logprob - inference logprob of each sampled token",
    ),  # fmt: skip
    Metric("masked/low", T, "fraction of loss tokens", "tokens masked (or clipped) below the trust region"),
    Metric("masked/high", T, "fraction of loss tokens", "tokens masked (or clipped) above the trust region"),
    Metric("grad_norm", T, "L2 norm", "global gradient norm before clipping"),
    Metric("lr", T, "learning rate", "AdamW learning rate of the step"),
    Metric(
        "perf/tokens_per_s",
        T,
        "tokens/s",
        "RL: tokens of the step's rows (all ranks) / seconds from the batch's arrival to published weights; "
        "SFT: tokens of the last log_interval steps' rows / their wall time",
    ),  # fmt: skip
    Metric(
        "time/step",
        T,
        "seconds",
        "trainer: wall time of the step, waiting for the batch included; orchestrator: wall time of the batch, "
        "waiting for weights included",
    ),  # fmt: skip
    Metric("time/wait_for_batch", T, "seconds", "wall time waiting for the batch's rollout files"),
    Metric("timestamp/train_start", T, "Unix time (s)", "when training on the batch started"),
    Metric("timestamp/train_end", T, "Unix time (s)", "when the step's weights were published"),
    # sft
    Metric("eval/loss", S, "nats per answer token", "mean -log p of the held-out examples' answer tokens"),
]

SOURCES = {
    ORCH: "`asyncrl orchestrator`, " + BATCH,
    T: "`asyncrl trainer` (rank 0), one line per step; SFT logs `loss`, `lr`, `grad_norm` and `perf/tokens_per_s` "
    "with source `sft`, every `log_interval` steps",
    S: "`asyncrl sft`",
}


def describe(name: str) -> Metric | None:
    """The registered metric a logged name belongs to, or None for a name nobody documented."""
    return next((m for m in METRICS if m.pattern.match(name)), None)


def render() -> str:
    lines = [
        "# Metrics reference",
        "",
        "Generated from `src/asyncrl/metric_names.py` by `python -m asyncrl.metric_names`; a test keeps it in",
        'sync. Each line of `<output_dir>/metrics.jsonl` is `{"step", "source", "time", ...metrics}`;',
        "`time` is the Unix time the line was written. Counts are per batch (one trainer step's rollouts),",
        "never cumulative. `<label>` is an environment's key in the config, `<name>` a reward function or",
        "rubric metric.",
    ]
    for source, about in SOURCES.items():
        lines += ["", f"## source `{source}`", "", about, "", "| metric | unit | meaning |", "|---|---|---|"]
        lines += [f"| `{m.name}` | {m.unit} | {m.meaning} |" for m in METRICS if m.source == source]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
