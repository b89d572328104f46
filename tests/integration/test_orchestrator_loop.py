"""The orchestrator's batch loop on its own, against a real `asyncrl inference` on a tiny model: with
max_async_level as large as the run is long no batch waits for new weights, so no trainer is needed. It
times where its time goes, and traces a few batches with torch.profiler."""

from __future__ import annotations

import json

import pytest
from servers import free_port, inference_command, running_server  # tests/integration, on sys.path under pytest

from asyncrl.config.schema import OrchestratorConfig
from asyncrl.metrics import read_jsonl
from asyncrl.models.offline import init_model
from asyncrl.orchestrator.loop import run_orchestrator

pytestmark = pytest.mark.integration

STEPS = 3
PARTS = ("time/wait_for_rollouts", "time/score", "time/pack", "time/write")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Three batches of reverse_text, the last two traced (after one batch of the profiler's warm-up)."""
    root = tmp_path_factory.mktemp("orchestrator")
    init_model(root / "tiny", "tiny", seed=0)
    port = free_port()
    with running_server(inference_command(root / "tiny", port), port, root / "inference.log") as url:
        cfg = OrchestratorConfig(
            model={"name": str(root / "tiny")},
            output_dir=root / "run",
            inference_urls=[url],
            max_steps=STEPS,
            max_async_level=STEPS,
            batch_size=8,
            group_size=4,
            seq_len=128,
            sampling={"max_tokens": 8},
            samples_per_step=0,
            profile={"dir": root / "run" / "profile", "wait": 0, "warmup": 1, "active": 2},
        )
        run_orchestrator(cfg)
    return root / "run"


def batches(output_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(output_dir / "metrics.jsonl") if "batch/rollouts" in r}


def test_the_batch_loop_times_waiting_scoring_packing_and_writing(run):
    """Between two cuts the loop packs and writes the batch before and waits for the next: together no more
    than the time between the cuts. Scoring runs beside it and is measured per rollout."""
    logged = batches(run)
    assert sorted(logged) == list(range(1, STEPS + 1))
    for step, batch in logged.items():
        assert all(batch[part] > 0 for part in PARTS), batch
        before = logged.get(step - 1, {"time/pack": 0.0, "time/write": 0.0})
        loop = batch["time/wait_for_rollouts"] + before["time/pack"] + before["time/write"]
        assert loop <= batch["time/step"], (step, batch, before)


def test_a_profiled_orchestrator_writes_a_chrome_trace_with_its_python_calls(run):
    trace = json.loads((run / "profile" / "orchestrator.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= names and "ProfilerStep#0" not in names
    # Packing runs in a worker thread: every thread is traced, Python calls included.
    assert any("orchestrator/packing.py(" in name and name.endswith(": pack") for name in names)
