"""Which metrics share a chart: the standard curves of a run, used by the dashboard and by `asyncrl plot`.

A panel lists metric names as the registry writes them (asyncrl/metric_names.py, placeholders allowed). A
logged metric in no panel still gets a chart: one per registered name (all environments' or servers'
values of a family together), or one of its own when the registry does not know it. So a new metric shows
up once it is logged, and registering it (or adding it to a panel here) is what groups it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from asyncrl.metric_names import Metric, describe


@dataclass(frozen=True)
class Panel:
    title: str
    metrics: tuple[str, ...]
    unit: str | None = None  # the y axis, where the metrics' units differ; default: the first one's

    @property
    def patterns(self) -> list[re.Pattern]:
        return [Metric(name, "", "", "").pattern for name in self.metrics]


PANELS = [
    Panel("reward", ("reward/mean", "reward/<label>/mean")),
    Panel("eval avg@n and pass@k", ("eval/<label>/avg@<n>", "eval/<label>/pass@<k>")),
    Panel("loss", ("loss",)),
    Panel("entropy", ("entropy",)),
    Panel("mismatch_kl", ("mismatch_kl",)),
    Panel("grad_norm", ("grad_norm",)),
    Panel("learning rate", ("lr",)),
    Panel("off-policy lag", ("off_policy/mean", "off_policy/max")),
    Panel(
        "dropped and failed rollouts",
        ("off_policy/dropped", "off_policy/mixed_versions", "rollouts/errored", "rollouts/truncated"),
        "rollouts per batch",
    ),
    Panel(
        "groups",
        (
            "groups/dispatched",
            "groups/cancelled",
            "groups/redispatched",
            "groups/retried",
            "groups/failed",
            "batch/filtered_groups",
            "batch/zero_advantage_groups",
        ),
        "groups per batch",
    ),  # fmt: skip
    Panel(
        "throughput",
        ("perf/tokens_per_s", "perf/generate_tokens_per_s", "perf/server/<i>/tokens_per_s"),
        "tokens/s (trained; generated)",
    ),
    Panel("queue and groups in flight", ("queue/groups", "groups/in_flight", "server/<i>/groups_in_flight"), "groups"),
    Panel(
        "failed requests",
        (
            "failed_requests/client_error",
            "failed_requests/server_error",
            "failed_requests/connection",
            "failed_requests/timeout",
        ),
        "requests per batch",
    ),
    Panel("inference idle", ("perf/inference_idle", "perf/server/<i>/idle")),
    Panel("policy versions", ("policy_version", "server/<i>/policy_version")),
    Panel("inference servers up", ("pool/servers_up", "server/<i>/up"), "servers"),
    Panel("lengths", ("seq_len/mean", "completion_len/mean")),
    Panel("time per step", ("time/step", "time/generate", "time/wait_for_weights", "time/wait_for_batch")),
    Panel(
        "where the orchestrator's time goes",
        ("time/wait_for_rollouts", "time/score", "time/pack", "time/write"),
        "seconds per batch",
    ),
    Panel(
        "where the trainer's time goes",
        ("time/forward_backward", "time/optimizer", "time/publish", "time/publish_gather", "time/publish_write"),
        "seconds per step",
    ),
    Panel(
        "orchestrator event loop lag",
        ("event_loop_lag_ms/p50", "event_loop_lag_ms/p99", "event_loop_lag_ms/max"),
    ),
    Panel("masked tokens", ("masked/low", "masked/high")),
    Panel("SFT eval loss", ("eval/loss",)),
]

NOT_CHARTED = ("timestamp/",)  # wall-clock instants, not curves


def chart_of(name: str) -> str | None:
    """The title of the chart a logged metric goes to; None for metrics never charted."""
    if name.startswith(NOT_CHARTED):
        return None
    for panel in PANELS:
        if any(p.match(name) for p in panel.patterns):
            return panel.title
    metric = describe(name)
    return metric.name if metric else name


def unit_of(name: str) -> str:
    """The y axis of a logged metric's chart: its panel's unit, else the metric's; "" when nobody knows it."""
    panel = next((p for p in PANELS if p.title == chart_of(name)), None)
    if panel is not None and panel.unit is not None:
        return panel.unit
    metric = describe(name)
    return metric.unit if metric else ""
