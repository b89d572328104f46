"""The parts of the plan model read from a finished `asyncrl rl` run of the user's own config.

Steady steps only (the first `skip` are start-up). Rates are ratios of sums over those steps; the
handoffs are means, since the round trip is their sum (at max_async_level >= 1 they alternate between
short and long from step to step, and a median of such a series is either):

- engine tokens/s per replica: a replica's share of the batches' generated tokens (`perf/server/<i>/
  tokens_per_s` x `time/step`, summed over servers, over replicas) / the busiest server's busy seconds
  (`(1 - perf/server/<i>/idle)` x `time/step`): a batch is done when its busiest server is;
- trainer tokens/s per rank: `batch/tokens` / (`time/forward_backward` + `time/optimizer`) / ranks, so
  the rate is per batch token (rows that dynamic sampling or zero advantages leave out still count);
- publish: `time/publish` (the trainer held), and W = when the inference log says "policy version N live"
  minus the trainer's `timestamp/train_end` of step N;
- D = the trainer's `timestamp/train_start` minus the later of the orchestrator's `timestamp/generate_end`
  and the trainer's previous `timestamp/train_end` (a batch that waits for a busy trainer is queueing);
- S = batch n's `timestamp/generate_start` minus the later of when version n - L - 1 (the oldest its
  groups may be sent to) went live and batch n - 1's cut.

G's and T's step-to-step variation: the coefficients of variation of the busiest server's busy seconds
and of forward + backward + optimizer seconds over the steady steps.

A colocated run's rates are measured with server and trainer sharing the GPU, so its parts say so
(`rates_while_colocated`): the model then lets the two overlap, as they did.
"""

from __future__ import annotations

import re
import statistics
import time
import tomllib
from pathlib import Path

from asyncrl.errors import AsyncRLError
from asyncrl.metrics import read_jsonl
from asyncrl.plan.model import Parts, Publish

LIVE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*policy version (\d+) live")


def live_times(log_dir: Path) -> dict[int, float]:
    """Unix time each policy version first went live on a server, from the inference logs (local time)."""
    found: dict[int, float] = {}
    for log in sorted(log_dir.glob("inference*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if match := LIVE.match(line):
                when = time.mktime(time.strptime(match[1], "%Y-%m-%d %H:%M:%S")) + int(match[2]) / 1000
                found.setdefault(int(match[3]), when)
    return found


def measured_step_s(run_dir: Path, skip: int = 2) -> float:
    """Wall seconds per steady step, from the trainer's `timestamp/train_end`: steadier than the median of
    `time/step`, which at max_async_level >= 1 alternates between steps that wait and steps that do not."""
    _, trainer, steps = _steady(run_dir, skip)
    ends = [trainer[n]["timestamp/train_end"] for n in steps]
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def _steady(run_dir: Path, skip: int) -> tuple[dict[int, dict], dict[int, dict], list[int]]:
    """Every step's orchestrator batch record and trainer record, by step, and the steady steps."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise AsyncRLError(f"'{run_dir}' has no metrics.jsonl (give the output_dir of a finished `asyncrl rl` run)")
    rows = read_jsonl(path)
    orchestrator = {r["step"]: r for r in rows if r["source"] == "orchestrator" and "batch/tokens" in r}
    trainer = {r["step"]: r for r in rows if r["source"] == "trainer"}
    steps = sorted(set(orchestrator) & set(trainer))[skip:]
    if len(steps) < 2:
        raise AsyncRLError(
            f"'{run_dir}' has {len(steps)} step(s) after the first {skip}: calibrating needs 2 at least "
            f"(run it with --max-steps {skip + 3} or more)"
        )
    return orchestrator, trainer, steps


def layout(run_dir: Path) -> tuple[int, int]:
    """(inference replicas, trainer ranks) of the run."""
    config = _orchestrator_config(run_dir)
    return len(config["inference_urls"]), config["num_trainer_ranks"]


def _orchestrator_config(run_dir: Path) -> dict:
    configs = run_dir / "configs" / "orchestrator.toml"
    if not configs.exists():
        raise AsyncRLError(f"'{run_dir}' has no configs/orchestrator.toml (give the output_dir of an `asyncrl rl` run)")
    return tomllib.loads(configs.read_text())


def calibrate(run_dir: Path, skip: int = 2) -> Parts:
    config = _orchestrator_config(run_dir)
    replicas, ranks = layout(run_dir)
    orchestrator, trainer, steps = _steady(run_dir, skip)  # all steps: D and S look at the one before
    batches = [orchestrator[n] for n in steps]

    # A batch is generated when its busiest server is done: the rate per replica is a replica's share of the
    # batch's tokens over that server's busy seconds, so an uneven split (or servers sharing cores) is in it.
    generated = 0.0
    generate_s = []  # per step: the busiest server's busy seconds
    for o in batches:
        generated += sum(o[f"perf/server/{i}/tokens_per_s"] for i in range(replicas)) * o["time/step"] / replicas
        generate_s.append(max(1 - o[f"perf/server/{i}/idle"] for i in range(replicas)) * o["time/step"])
    busy = sum(generate_s)
    train_s_per_step = [trainer[n]["time/forward_backward"] + trainer[n]["time/optimizer"] for n in steps]
    batch_tokens = sum(o["batch/tokens"] for o in batches)
    completions = sum(o["completion_len/mean"] * o["batch/rollouts"] for o in batches)
    rollouts = sum(o["batch/rollouts"] for o in batches)
    train_s = sum(train_s_per_step)

    live = live_times(run_dir / "logs")
    level = config["max_async_level"]
    loads = [live[n] - trainer[n]["timestamp/train_end"] for n in steps if n in live]
    # A handoff counts from when the trainer could first have started: the batch cut and the previous step
    # published (at max_async_level >= 1 a batch that waits for a busy trainer is queueing, not handoff).
    handoffs = [
        trainer[n]["timestamp/train_start"]
        - max(orchestrator[n]["timestamp/generate_end"], trainer.get(n - 1, {}).get("timestamp/train_end", 0.0))
        for n in steps
    ]
    # Likewise a dispatch counts from when the batch could first have been sent: its oldest allowed version
    # live and the previous batch cut.
    dispatches = [
        orchestrator[n]["timestamp/generate_start"]
        - max(live[n - level - 1], orchestrator.get(n - 1, {}).get("timestamp/generate_end", 0.0))
        for n in steps
        if n - level - 1 in live
    ]
    return Parts(
        batch_size=config["batch_size"],
        prompt_tokens=(batch_tokens - completions) / rollouts,
        completion_tokens=completions / rollouts,
        max_async_level=level,
        engine_tokens_per_s=generated / max(busy, 1e-9) if generated else 0.0,
        trainer_tokens_per_s=batch_tokens / train_s / ranks,
        efficiency_per_doubling=1.0,
        publish={
            config["weight_transfer"]["mode"]: Publish(
                statistics.fmean(trainer[n]["time/publish"] for n in steps),
                max(statistics.fmean(loads), 0.0) if loads else 0.0,
            )
        },
        batch_handoff_s=max(statistics.fmean(handoffs), 0.0),
        dispatch_latency_s=max(statistics.fmean(dispatches), 0.0) if dispatches else 0.0,
        rates_while_colocated=config["weight_transfer"]["mode"] == "colocated",
        generate_cv=_cv(generate_s),
        train_cv=_cv(train_s_per_step),
    )


def _cv(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else 0.0
