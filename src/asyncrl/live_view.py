"""The live view of `asyncrl rl`: what the trainer has trained and what the orchestrator has generated,
read from metrics.jsonl, as a table on a terminal or a line per trained step otherwise. `console` is the one
everything `asyncrl rl` says goes through, so that a line printed while the table is live does not tear it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from asyncrl.trackers import Trackers

console = Console(stderr=False, highlight=False)


class Progress:
    """The live view, read from metrics.jsonl: what the trainer has trained and what the orchestrator has
    generated, side by side. They differ: with max_async_level >= 1 the orchestrator generates batch n + 1
    while the trainer trains on batch n, so the newest batch's reward is not the reward of the batch the
    trainer just stepped on. The lines read are also handed to the run's experiment trackers, if any."""

    def __init__(self, metrics_path: Path, max_steps: int, trackers: Trackers | None = None):
        self.path = metrics_path
        self.samples_path = metrics_path.with_name("samples.jsonl")
        self.max_steps = max_steps
        self.trackers = trackers
        self.start = time.time()
        self.trainer: dict = {}
        self.batch: dict = {}  # the newest batch's line
        self.batch_rewards: dict[int, float] = {}
        self.stale = {"dropped": 0, "cancelled": 0}  # rollouts dropped and groups cancelled as too old, so far
        self.offsets = {self.path: 0, self.samples_path: 0}
        self.printed_step = 0

    def _read_new(self, path: Path) -> list[dict]:
        """The lines appended since the last read (whole lines only)."""
        if not path.exists():
            return []
        with open(path, "rb") as f:
            f.seek(self.offsets[path])
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offsets[path] += len(complete)
        return [json.loads(line) for line in complete.decode().splitlines() if line.strip()]

    def refresh(self) -> None:
        for record in self._read_new(self.path):
            if record["source"] == "trainer":
                self.trainer = record
            elif record["source"] == "orchestrator" and "reward/mean" in record:  # a batch, not an eval
                self.batch = record
                self.batch_rewards[record["step"]] = record["reward/mean"]
                self.stale["dropped"] += record.get("off_policy/dropped", 0)
                self.stale["cancelled"] += record.get("groups/cancelled", 0)
            if self.trackers is not None:
                self.trackers.log(record)
        if self.trackers is not None:
            self.trackers.log_samples(self._read_new(self.samples_path))

    def close(self) -> None:
        self.refresh()
        if self.trackers is not None:
            self.trackers.close()

    def _figures(self) -> dict[str, str]:
        step, batch = self.trainer.get("step", 0), self.batch.get("step", 0)
        elapsed = time.time() - self.start
        eta = elapsed / step * (self.max_steps - step) if step else None
        return {
            "trained": f"{step}/{self.max_steps}",
            "reward": f"{self.batch_rewards.get(step, float('nan')):.3f}",
            "loss": f"{self.trainer.get('loss', float('nan')):.4f}",
            "mismatch_kl": f"{self.trainer.get('mismatch_kl', float('nan')):.2e}",
            "train": f"{self.trainer.get('perf/tokens_per_s', 0):.0f}",
            "batch": str(batch),
            "batch reward": f"{self.batch.get('reward/mean', float('nan')):.3f}",
            "generate": f"{self.batch.get('perf/generate_tokens_per_s', 0):.0f}",
            "servers": f"{self.batch.get('pool/servers_up', '?')}/{self._servers()}",
            "queue": f"{self.batch.get('queue/rollouts', 0)} / {self.batch.get('groups/in_flight', 0)}",
            "stale": f"{self.stale['dropped']} / {self.stale['cancelled']}",
            "elapsed": f"{elapsed:.0f}s",
            "eta": "?" if eta is None else f"{eta:.0f}s",
        }

    def _servers(self) -> int | str:
        return sum(key.endswith("/up") and key.startswith("server/") for key in self.batch) or "?"

    def line(self) -> str:
        f = self._figures()
        return (
            f"trained step {f['trained']} (its batch: reward {f['reward']}; loss {f['loss']}, "
            f"mismatch_kl {f['mismatch_kl']}, {f['train']} tok/s)  |  newest batch generated: {f['batch']} "
            f"(reward {f['batch reward']}, {f['generate']} tok/s; servers up {f['servers']}, rollouts queued / "
            f"groups in flight {f['queue']}, dropped / cancelled {f['stale']})  |  elapsed {f['elapsed']}, "
            f"ETA {f['eta']}"
        )

    def table(self) -> Table:
        f = self._figures()
        table = Table(
            title="asyncrl rl",
            caption="the orchestrator generates the next batches while the trainer trains on an earlier one",
            show_header=True,
        )
        columns = {
            "trained step": "trained",
            "its batch's reward": "reward",
            "loss": "loss",
            "mismatch_kl": "mismatch_kl",
            "train tok/s": "train",
            "newest batch": "batch",
            "newest batch's reward": "batch reward",
            "generate tok/s": "generate",
            "servers up": "servers",
            "queued / in flight": "queue",
            "dropped / cancelled": "stale",
            "elapsed": "elapsed",
            "ETA": "eta",
        }
        for column in columns:
            table.add_column(column, justify="right")
        table.add_row(*(f[key] for key in columns.values()))
        return table

    def new_step(self) -> bool:
        step = self.trainer.get("step", 0)
        if step > self.printed_step:
            self.printed_step = step
            return True
        return False
