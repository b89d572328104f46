"""asyncrl plan: the step model's formulas and the search for the best split."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from asyncrl.errors import AsyncRLError
from asyncrl.plan.calibrate import calibrate
from asyncrl.plan.model import Parts, Publish, best_splits, load_parts, parts_file, predict

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plan" / "h200_qwen3_0.6b.json"

# B c = 1,000 generated and B (p + c) = 4,000 trained tokens per step.
PARTS = Parts(
    batch_size=10, prompt_tokens=300, completion_tokens=100, max_async_level=1,
    engine_tokens_per_s=500, trainer_tokens_per_s=1000, efficiency_per_doubling=0.9,
    publish={"filesystem": Publish(0.5, 0.3), "colocated": Publish(0.1, 0.05)}, batch_handoff_s=0.2,
    gpus_per_node=4,
)  # fmt: skip


def test_sync_step_is_the_sum_of_generation_training_publish_and_handoffs():
    sync = dataclasses.replace(PARTS, max_async_level=0)
    p = predict(sync, 2, 1, "filesystem")  # G = 1000 / (2 x 500) = 1, T = 4, P = 0.5, H = 0.3 + 0.2
    assert p.step_s == pytest.approx(1 + 4 + 0.5 + 0.5)
    assert p.trained_tokens_per_s == pytest.approx(4000 / 6)
    assert p.trainer_idle == pytest.approx(1 - 4.5 / 6) and p.inference_idle == pytest.approx(1 - 1 / 6)


def test_dispatch_latency_is_part_of_the_round_trip():
    late = dataclasses.replace(PARTS, max_async_level=0, dispatch_latency_s=0.25)
    assert predict(late, 2, 1, "filesystem").step_s == pytest.approx(1 + 4 + 0.5 + 0.5 + 0.25)


def test_async_step_is_the_slower_side_when_handoffs_are_small():
    fast = dataclasses.replace(PARTS, publish={"filesystem": Publish(0.5, 0.0)}, batch_handoff_s=0.0)
    p = predict(fast, 1, 4, "filesystem")  # G = 2, T = 4000 / (4 x 1000 x 0.81) = 1.235, + P 0.5
    assert p.step_s == pytest.approx(2) and p.bound == "generation" and p.inference_idle == pytest.approx(0)
    p = predict(fast, 4, 2, "filesystem")  # G = 0.5, T = 4000 / (2 x 1000 x 0.9) = 2.222, + P 0.5
    assert p.step_s == pytest.approx(4000 / 1800 + 0.5) and p.bound == "training"


def test_each_side_pays_its_own_handoff_every_step():
    handoffs = dataclasses.replace(PARTS, publish={"filesystem": Publish(0.5, 0.0)}, batch_handoff_s=0.3)
    p = predict(handoffs, 4, 2, "filesystem")  # T + P + D = 2.222 + 0.5 + 0.3
    assert p.step_s == pytest.approx(4000 / 1800 + 0.5 + 0.3) and p.bound == "training"
    p = predict(dataclasses.replace(handoffs, batch_handoff_s=0.0, dispatch_latency_s=0.4), 1, 4, "filesystem")
    assert p.step_s == pytest.approx(2 + 0.4) and p.bound == "generation"  # G + S


def test_async_step_is_bounded_by_the_round_trip_over_max_async_level_plus_one():
    p = predict(PARTS, 2, 2, "filesystem")  # G = 1, T + P + D = 2.922, round trip (1 + 2.722 + 0.5) / 2 = 2.111
    assert p.bound == "training"
    slow = dataclasses.replace(PARTS, publish={"filesystem": Publish(0.5, 4.0)})
    p = predict(slow, 2, 2, "filesystem")
    assert p.bound == "round trip" and p.step_s == pytest.approx((1 + 4000 / 1800 + 0.5 + 4.2) / 2)


def test_colocated_takes_turns_without_overlap():
    p = predict(PARTS, 2, 2, "colocated")
    assert p.step_s == pytest.approx(1 + 4000 / 1800 + 0.1 + 0.05 + 0.2) and p.bound == "round trip"


def test_colocated_rates_measured_while_sharing_overlap_as_gpus_of_their_own():
    shared = dataclasses.replace(PARTS, rates_while_colocated=True)
    p = predict(shared, 2, 2, "colocated")  # G = 1, T + P + D = 2.222 + 0.1 + 0.2, round trip (3.322 + 0.25) / 2
    assert p.step_s == pytest.approx(4000 / 1800 + 0.1 + 0.2) and p.bound == "training"
    sync = predict(dataclasses.replace(shared, max_async_level=0), 2, 2, "colocated")
    assert sync.step_s == pytest.approx(1 + 4000 / 1800 + 0.1 + 0.05 + 0.2)


def test_step_to_step_variation_keeps_the_sync_sum_and_lengthens_a_balanced_async_step():
    # One server, one rank: T + P = 4000 / 1000 + 0.5 = 4.5, and G = 1000 / g = 4.5 as well.
    balanced = dataclasses.replace(PARTS, engine_tokens_per_s=1000 / 4.5, batch_handoff_s=0.0)
    varied = dataclasses.replace(balanced, generate_cv=0.4, train_cv=0.4)
    sync, varied_sync = (
        predict(dataclasses.replace(p, max_async_level=0), 1, 1, "filesystem") for p in (balanced, varied)
    )
    assert varied_sync.step_s == pytest.approx(sync.step_s, rel=1e-9)  # L = 0: a sum, so only the means count
    steady, stalled = predict(balanced, 1, 1, "filesystem"), predict(varied, 1, 1, "filesystem")
    # The round trip (4.5 + 4.5 + W 0.3) / 2 bounds the mean step; with variation the sides stall each other.
    assert steady.step_s == pytest.approx(4.65) and 4.65 * 1.05 < stalled.step_s < sync.step_s
    assert predict(varied, 1, 1, "filesystem").step_s == stalled.step_s  # seeded: the same every time
    lopsided = dataclasses.replace(varied, engine_tokens_per_s=1000 / 0.5)  # G = 0.5: the trainer never waits
    assert predict(lopsided, 1, 1, "filesystem").step_s == pytest.approx(4.5, rel=0.01)


@pytest.mark.parametrize("gpus", [2, 3, 4, 8, 12])
def test_search_finds_the_split_a_brute_force_grid_finds(gpus):
    grid = [
        predict(PARTS, i, t, "filesystem")
        for i in range(1, gpus + 1)
        for t in range(1, gpus + 1)
        if i + t <= gpus and (gpus <= PARTS.gpus_per_node or (i % 4 == 0 and t % 4 == 0))
    ]
    grid.append(predict(PARTS, gpus, gpus, "colocated"))
    best = max(grid, key=lambda p: p.trained_tokens_per_s)
    found = best_splits(PARTS, gpus, "filesystem")
    assert found[0].trained_tokens_per_s == pytest.approx(best.trained_tokens_per_s)
    assert (found[0].inference_gpus, found[0].trainer_gpus, found[0].mode) == (
        best.inference_gpus, best.trainer_gpus, best.mode
    )  # fmt: skip
    assert [p.trained_tokens_per_s for p in found] == sorted((p.trained_tokens_per_s for p in found), reverse=True)


def test_the_example_parts_load_and_a_missing_mode_is_named():
    parts = load_parts(EXAMPLE)
    assert parts.batch_size == 64 and set(parts.publish) == {"filesystem", "broadcast", "colocated"}
    with pytest.raises(AsyncRLError, match="publish.nvlink"):
        predict(parts, 1, 1, "nvlink")


def _trainer_bound_run(folder: Path, mode: str) -> None:
    """A finished run's files at max_async_level 1 where the trainer is the slower side: every batch is cut
    long before the trainer takes it (queueing), which the handoff D must not count."""
    (folder / "configs").mkdir(parents=True)
    (folder / "logs").mkdir()
    (folder / "configs" / "orchestrator.toml").write_text(
        f'batch_size = 8\nmax_async_level = 1\ninference_urls = ["http://127.0.0.1:1"]\nnum_trainer_ranks = 1\n'
        f'[weight_transfer]\nmode = "{mode}"\n'
    )
    start, rows, live = 1_800_000_000.0, [], {}
    for n in range(1, 9):
        train_start = start + 100 + 1.0 * n + 0.01  # the previous step ended at start + 100 + n
        train_end = train_start + 0.99
        live[n] = train_end + 0.03
        rows.append(
            {
                "step": n,
                "source": "trainer",
                "time/forward_backward": 0.8,
                "time/optimizer": 0.1,
                "time/publish": 0.09,
                "timestamp/train_start": train_start,
                "timestamp/train_end": train_end,
            }
        )
    for n in range(1, 9):
        generate_start = max(live.get(n - 2, start), start + 50 + 0.3 * (n - 1)) + 0.02
        rows.append({"step": n, "source": "orchestrator", "batch/tokens": 800, "batch/rollouts": 8,
                     "completion_len/mean": 50.0, "time/step": 0.3, "perf/server/0/tokens_per_s": 2000.0,
                     "perf/server/0/idle": 0.5, "timestamp/generate_start": generate_start,
                     "timestamp/generate_end": start + 50 + 0.3 * n})  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stamp = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f",{round(t % 1 * 1000):03d}"  # noqa: E731
    (folder / "logs" / "inference.log").write_text(
        "".join(f"{stamp(t)} INFO asyncrl.inference: policy version {n} live\n" for n, t in live.items())
    )


@pytest.mark.parametrize("mode", ["filesystem", "colocated"])
def test_calibration_counts_handoffs_from_when_the_trainer_was_free_not_the_batchs_wait_in_the_queue(tmp_path, mode):
    _trainer_bound_run(tmp_path, mode)
    parts = calibrate(tmp_path)
    assert parts.batch_handoff_s == pytest.approx(0.01, abs=1e-6)  # not the ~50 s the batches queued
    assert parts.dispatch_latency_s == pytest.approx(0.02, abs=2e-3)  # log times have millisecond steps
    assert parts.publish[mode].load_s == pytest.approx(0.03, abs=2e-3)
    assert parts.rates_while_colocated == (mode == "colocated")
    predicted = predict(parts, 1, 1, mode)
    assert predicted.bound == "training" and predicted.step_s == pytest.approx(0.9 + 0.09 + 0.01, rel=1e-3)


def test_a_parts_file_gives_each_sides_step_to_step_variation(tmp_path):
    raw = json.loads(EXAMPLE.read_text())
    raw["engine"]["step_cv"], raw["trainer"]["step_cv"] = 0.3, 0.2
    (tmp_path / "parts.json").write_text(json.dumps(raw))
    parts = load_parts(tmp_path / "parts.json")
    assert (parts.generate_cv, parts.train_cv) == (0.3, 0.2) and load_parts(EXAMPLE).generate_cv == 0.0


def test_calibrated_parts_print_as_a_parts_file_that_loads_back(tmp_path):
    _trainer_bound_run(tmp_path / "run", "colocated")
    parts = calibrate(tmp_path / "run")
    (tmp_path / "parts.json").write_text(json.dumps(parts_file(parts)))
    assert load_parts(tmp_path / "parts.json") == parts
