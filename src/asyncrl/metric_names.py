"""Every metric name a run logs to metrics.jsonl, with its unit and meaning.

The dashboard, `asyncrl plot`, the trackers and docs/metrics.md all read this one list, so a name is
documented once. Names hold placeholders for the parts a run chooses: `<label>` (an environment's key in
the config), `<name>` (a reward function or rubric metric), `<i>` (an inference server's index, or a decoder
layer's in `moe/` names), `<n>` and `<k>` (avg@n, pass@k).

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
    ),
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
    ),
    Metric("completion_len/mean", ORCH, "tokens per rollout", "mean number of tokens the policy sampled in a rollout"),
    Metric(
        "off_policy/mean",
        ORCH,
        "policy versions",
        "mean over rollouts of (step - 1) - the oldest policy version among its tokens: how many trainer steps "
        "older than the trainer's weights the rollout is",
    ),
    Metric("off_policy/max", ORCH, "policy versions", "the largest such lag in the batch"),
    Metric(
        "off_policy/dropped",
        ORCH,
        "rollouts per batch",
        "rollouts dropped as older than max_async_level allows while this batch was waited for",
    ),
    Metric(
        "off_policy/mixed_versions",
        ORCH,
        "rollouts per batch",
        "rollouts whose tokens came from more than one policy version (weights changed mid-episode)",
    ),
    Metric("batch/rollouts", ORCH, "rollouts", "rollouts in the batch"),
    Metric("batch/groups", ORCH, "groups", "groups in the batch"),
    Metric("batch/tokens", ORCH, "tokens", "tokens of the batch's rollouts (prompt, sampled and environment)"),
    Metric(
        "prefix_cache/prompt_tokens",
        ORCH,
        "tokens per batch",
        "prompt tokens the batch's requests sent to be prefilled, every turn's (a group's shared first prompt once)",
    ),
    Metric(
        "prefix_cache/cached_tokens",
        ORCH,
        "tokens per batch",
        "of those, the ones the server read from its prefix cache (0 without inference.prefix_cache)",
    ),
    Metric("prefix_cache/hit_rate", ORCH, "fraction", "prefix_cache/cached_tokens / prefix_cache/prompt_tokens"),
    Metric(
        "batch/zero_advantage_groups",
        ORCH,
        "groups per batch",
        "groups of the batch whose advantages are all zero (no learning signal)",
    ),
    Metric(
        "batch/filtered_groups",
        ORCH,
        "groups per batch",
        "groups left out by dynamic sampling (no signal) since the last batch",
    ),
    Metric("batch/samples", ORCH, "token samples per batch", "token samples sent to the trainer"),
    Metric("groups/dispatched", ORCH, "groups per batch", "groups sent to the inference servers since the last batch"),
    Metric("groups/cancelled", ORCH, "groups per batch", "groups in flight cancelled as too old, since the last batch"),
    Metric(
        "groups/redispatched",
        ORCH,
        "groups per batch",
        "groups sent again after their server went down, since the last batch",
    ),
    Metric(
        "groups/retried",
        ORCH,
        "groups per batch",
        "groups sent again after a request failed by its server's fault (5xx, connection, timeout), since the "
        "last batch",
    ),
    Metric(
        "groups/failed",
        ORCH,
        "groups per batch",
        "groups left out because a request was rejected (4xx) or failed on every retry, since the last batch",
    ),
    Metric("groups/in_flight", ORCH, "groups", "groups in flight when the batch was cut"),
    Metric("queue/rollouts", ORCH, "rollouts", "rollouts left in the queue after the cut"),
    Metric("queue/groups", ORCH, "groups", "groups left in the queue after the cut"),
    Metric("policy_version", ORCH, "policy version", "the oldest version the servers that are up held at the cut"),
    Metric("pool/oldest_version", ORCH, "policy version", "the same: the oldest version among the servers up"),
    Metric("pool/servers_up", ORCH, "servers", "inference servers up at the cut"),
    Metric("pool/times_down", ORCH, "times, since the start", "how often a server was marked down"),
    Metric(
        "failed_requests/client_error",
        ORCH,
        "requests per batch",
        "generate requests the servers rejected (HTTP 4xx: the request's own fault), since the last batch",
    ),
    Metric("failed_requests/server_error", ORCH, "requests per batch", "generate requests answered with HTTP 5xx"),
    Metric(
        "failed_requests/connection",
        ORCH,
        "requests per batch",
        "generate requests whose connection was refused or broke before the answer",
    ),
    Metric(
        "failed_requests/timeout", ORCH, "requests per batch", "generate requests unanswered within request_timeout"
    ),
    Metric("server/<i>/up", ORCH, "1 up, 0 down", "inference server i at the cut"),
    Metric("server/<i>/policy_version", ORCH, "policy version", "the version server i held at the cut"),
    Metric("server/<i>/groups_in_flight", ORCH, "groups", "groups in flight on server i at the cut"),
    Metric(
        "perf/server/<i>/tokens_per_s",
        ORCH,
        "tokens/s",
        "completion tokens of the groups and eval requests server i finished / seconds since the last batch",
    ),
    Metric(
        "perf/server/<i>/idle",
        ORCH,
        "fraction of time",
        "share of the time since the last batch that server i had nothing in flight",
    ),
    Metric("perf/inference_idle", ORCH, "fraction of time", "perf/server/<i>/idle, the mean over servers"),
    Metric("perf/generate_tokens_per_s", ORCH, "tokens/s", "perf/server/<i>/tokens_per_s, the sum over servers"),
    Metric("time/generate", ORCH, "seconds", "from the first of the batch's groups being sent to the cut"),
    Metric(
        "time/wait_for_weights",
        ORCH,
        "seconds",
        "time since the last batch that dispatch was held back by the off-policy bound",
    ),
    Metric(
        "time/wait_for_rollouts",
        ORCH,
        "seconds",
        "the batch loop waiting for the queue to hold this batch's scored groups; between the cuts of batches "
        "n - 1 and n the loop packs and writes batch n - 1 (their time/pack and time/write), logs, then waits, so "
        "with those two it makes at most time/step",
    ),
    Metric(
        "time/score",
        ORCH,
        "seconds",
        "scoring the batch's rollouts (the rubric's reward functions, or an env-server's /score), summed over "
        "rollouts; they are scored alongside each other and generation, so it can pass time/step (0 for "
        "environments that score their own rollouts, as verifiers does)",
    ),
    Metric(
        "time/pack",
        ORCH,
        "seconds",
        "building the batch's trainer rows: its token samples, packed into micro-batches per rank (in a worker "
        "thread, the event loop runs on)",
    ),
    Metric("time/write", ORCH, "seconds", "writing the batch's rollouts/step_n/rank_R files (in the same thread)"),
    Metric(
        "event_loop_lag_ms/p50",
        ORCH,
        "milliseconds",
        "median of how late the orchestrator's event loop woke from a 10 ms sleep, since the last batch: how long "
        "blocking work held up every request, dispatch and weight update (docs/orchestrator.md)",
    ),
    Metric("event_loop_lag_ms/p99", ORCH, "milliseconds", "the 99th percentile of those wake-up delays"),
    Metric("event_loop_lag_ms/max", ORCH, "milliseconds", "the longest of those wake-up delays"),
    Metric("timestamp/generate_start", ORCH, "Unix time (s)", "when the first of the batch's groups was sent"),
    Metric("timestamp/generate_end", ORCH, "Unix time (s)", "when the batch was cut"),
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
    ),
    Metric("entropy", T, "nats per loss token", "mean entropy of the trainer's next-token distribution"),
    Metric(
        "mismatch_kl",
        T,
        "nats per loss token",
        "mean of exp(r) - r - 1, r = trainer logprob - inference logprob of each sampled token",
    ),
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
    ),
    Metric(
        "time/step",
        T,
        "seconds",
        "trainer: wall time of the step, waiting for the batch included; orchestrator: time since the previous "
        "batch was cut",
    ),
    Metric("batch/micro_batches", T, "micro-batches", "micro-batches each rank trained on in the step"),
    Metric(
        "batch/fill",
        T,
        "fraction of seq_len",
        "how full rank 0's packed micro-batches were: their tokens over micro-batches x trainer.seq_len (rows "
        "are not padded: below 1, micro-batches were packed short of seq_len)",
    ),
    Metric("time/wait_for_batch", T, "seconds", "wall time waiting for the batch's rollout files"),
    Metric(
        "time/forward_backward",
        T,
        "seconds",
        "reading the batch's checks, then every micro-batch's forward, loss and backward (the device included)",
    ),
    Metric("time/optimizer", T, "seconds", "gradient clipping and the AdamW step"),
    Metric(
        "time/publish",
        T,
        "seconds",
        "gathering the weights and handing them to the transfer (a file write runs on in the background); "
        "with time/wait_for_batch, time/forward_backward and time/optimizer it makes time/step",
    ),
    Metric(
        "time/publish_gather",
        T,
        "seconds",
        "of time/publish: gathering the full weights from the ranks (every rank takes part)",
    ),
    Metric(
        "time/publish_write",
        T,
        "seconds",
        "of time/publish, the rest: waiting for the previous version's background write to end, then rank 0 "
        "handing this one over (the checkpoint layout and a host copy, then the broadcast sent or the write "
        "started)",
    ),
    # mixture-of-experts models (docs/models.md): over the step's tokens, all ranks
    Metric(
        "moe/aux_loss",
        T,
        "balancing loss (1 = balanced)",
        "E x sum over experts of (share of token-expert pairs) x (mean router probability), mean over MoE layers; "
        "loss.router_aux_coef weighs it into the loss",
    ),
    Metric("moe/router_entropy", T, "nats per token", "entropy of the router's distribution over experts"),
    Metric(
        "moe/load_imbalance",
        T,
        "max / mean pairs per expert",
        "the busiest expert's token-expert pairs over the mean, mean over MoE layers (1 = balanced)",
    ),
    Metric("moe/load_imbalance_max", T, "max / mean pairs per expert", "moe/load_imbalance of the worst layer"),
    Metric("moe/layer_<i>/load_imbalance", T, "max / mean pairs per expert", "moe/load_imbalance of decoder layer i"),
    Metric("timestamp/train_start", T, "Unix time (s)", "when training on the batch started"),
    Metric("timestamp/train_end", T, "Unix time (s)", "when the step's weights were published"),
    # sft
    Metric("eval/loss", S, "nats per answer token", "mean -log p of the held-out examples' answer tokens"),
    Metric("tokens/answer", S, "tokens", "answer (loss) tokens trained on so far, all ranks"),
    Metric("tokens/total", S, "tokens", "tokens of the rows trained on so far (prompts and padding-free answers)"),
]

SOURCES = {
    ORCH: "`asyncrl orchestrator`, " + BATCH,
    T: "`asyncrl trainer` (rank 0), one line per step; SFT logs `loss`, `lr`, `grad_norm`, `perf/tokens_per_s` "
    "and the `moe/` metrics with source `sft`, every `log_interval` steps",
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
        '`time` is the Unix time the line was written. A count "per batch" is of one batch, or of the time',
        "since the previous batch was cut; the unit says when a count is since the start. `<label>` is an",
        "environment's key in the config, `<name>` a reward function or rubric metric, `<i>` an inference",
        "server's index (docs/orchestrator.md), or in `moe/` names a decoder layer's (docs/models.md).",
    ]
    for source, about in SOURCES.items():
        lines += ["", f"## source `{source}`", "", about, "", "| metric | unit | meaning |", "|---|---|---|"]
        lines += [f"| `{m.name}` | {m.unit} | {m.meaning} |" for m in METRICS if m.source == source]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
