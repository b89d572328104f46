"""Experiment trackers: Weights & Biases (`[wandb]`) and TensorBoard (`[tensorboard]`).

One process writes a run's tracker: under `asyncrl rl` the launcher, which already reads every process's
lines from metrics.jsonl and samples.jsonl for its live view, so one W&B run holds the inference,
orchestrator and trainer metrics together without the processes coordinating; under `asyncrl sft` the
SFT process (rank 0). A metric `name` logged with source `S` is tracked as `S/name` (the orchestrator and
the trainer both log `time/step`), against the run's `step`.

Tracking never takes a run down: a tracker that fails is reported once, on stderr, and dropped.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from asyncrl.config.schema import TensorBoardConfig, WandbConfig

NOT_METRICS = ("step", "source", "time")
SAMPLE_COLUMNS = ("step", "env", "prompt", "completion", "answer", "reward", "advantage")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    source = record.get("source", "run")
    return {
        f"{source}/{name}": value
        for name, value in record.items()
        if name not in NOT_METRICS and isinstance(value, int | float) and not isinstance(value, bool)
    }


class WandbTracker:
    def __init__(self, cfg: WandbConfig, output_dir: Path, config: dict[str, Any]):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or Path(output_dir).name,
            mode=cfg.mode,
            dir=output_dir,
            config=config,
            settings=wandb.Settings(silent=True, init_timeout=cfg.init_timeout),
        )
        # Steps of different sources arrive out of order (batch n + 1 before trainer step n): plot against
        # the logged `step`, not W&B's own row counter.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.samples = wandb.Table(columns=list(SAMPLE_COLUMNS), log_mode="INCREMENTAL")

    def log(self, record: dict[str, Any]) -> None:
        self.run.log({"step": record["step"], **scalars(record)})

    def log_samples(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self.samples.add_data(*(record.get(column) for column in SAMPLE_COLUMNS))
        self.run.log({"step": records[-1]["step"], "samples": self.samples})

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    def __init__(self, cfg: TensorBoardConfig, output_dir: Path, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(cfg.dir or Path(output_dir) / "tensorboard"))
        self.writer.add_text("config", _markdown_code(config))

    def log(self, record: dict[str, Any]) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def log_samples(self, records: list[dict[str, Any]]) -> None:
        rows = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
        for r in records:
            rows.append("| " + " | ".join(_cell(r.get(column)) for column in SAMPLE_COLUMNS) + " |")
        self.writer.add_text("samples", "\n".join(rows), records[-1]["step"])

    def close(self) -> None:
        self.writer.close()


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")[:500]


def _markdown_code(config: dict[str, Any]) -> str:
    import json

    return "```\n" + json.dumps(config, indent=2, default=str) + "\n```"


class Trackers:
    """The run's trackers, each dropped at its first failure with one line that names it."""

    def __init__(self, trackers: list[Any]):
        self.trackers = trackers

    @classmethod
    def open(
        cls, wandb: WandbConfig, tensorboard: TensorBoardConfig, output_dir: Path, config: dict[str, Any]
    ) -> Trackers:
        opened = []
        if wandb.mode != "disabled":
            opened.append(_guarded("wandb", lambda: WandbTracker(wandb, output_dir, config)))
        if tensorboard.enabled:
            opened.append(_guarded("tensorboard", lambda: TensorBoardTracker(tensorboard, output_dir, config)))
        return cls([t for t in opened if t is not None])

    def log(self, record: dict[str, Any]) -> None:
        self._each("log", record)

    def log_samples(self, records: list[dict[str, Any]]) -> None:
        if records:
            self._each("log_samples", records)

    def close(self) -> None:
        self._each("close")
        self.trackers = []

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker must never take the run down
                self.trackers.remove(tracker)
                _report(_name(tracker), e)


def _name(tracker: Any) -> str:
    return "wandb" if isinstance(tracker, WandbTracker) else "tensorboard"


def _guarded(name: str, make) -> Any:
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - includes ImportError: the extra is not installed
        _report(name, e)
        return None


def _report(name: str, error: Exception) -> None:
    hint = " (pip install 'asyncrl[track]')" if isinstance(error, ImportError) else ""
    first_line = (str(error).strip().splitlines() or [""])[0].rstrip(".")
    print(
        f"asyncrl: {name} tracking failed: {type(error).__name__}: {first_line}{hint}; the run goes on without it",
        file=sys.stderr,
        flush=True,
    )
