"""The live view of `asyncrl rl` (live_view.Progress) reads metrics.jsonl and keeps the trained step and the
newest generated batch apart: with max_async_level 1 batch n + 1 is generated while step n trains."""

from __future__ import annotations

import json

from asyncrl.live_view import Progress


def write(path, *records):
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def test_the_line_names_the_trained_steps_batch_and_the_newest_batch_apart(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write(
        metrics,
        {"step": 1, "source": "orchestrator", "reward/mean": 0.532, "perf/generate_tokens_per_s": 900.0},
        {"step": 2, "source": "orchestrator", "eval/rt/avg@4": 0.1},  # an eval line: not a batch
        {
            "step": 2,
            "source": "orchestrator",
            "reward/mean": 0.558,
            "perf/generate_tokens_per_s": 950.0,
            "pool/servers_up": 1,
            "server/0/up": 1,
            "server/1/up": 0,
            "queue/rollouts": 12,
            "groups/in_flight": 3,
            "off_policy/dropped": 4,
            "groups/cancelled": 1,
        },
        {"step": 1, "source": "trainer", "loss": 0.01, "mismatch_kl": 1e-3, "perf/tokens_per_s": 5000.0},
    )
    progress = Progress(metrics, max_steps=200)
    progress.refresh()
    line = progress.line()
    assert line.startswith("trained step 1/200 (its batch: reward 0.532; loss 0.0100, mismatch_kl 1.00e-03")
    assert "newest batch generated: 2 (reward 0.558, 950 tok/s; servers up 1/2" in line
    assert "rollouts queued / groups in flight 12 / 3, dropped / cancelled 4 / 1" in line
    assert progress.new_step() and not progress.new_step()


def test_a_line_being_written_is_read_once_whole(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write(metrics, {"step": 1, "source": "trainer", "loss": 0.5})
    with open(metrics, "a") as f:
        f.write('{"step": 2, "source": "trainer", "lo')  # the trainer is in the middle of its write
    progress = Progress(metrics, max_steps=3)
    progress.refresh()
    assert progress.trainer["step"] == 1
    with open(metrics, "a") as f:
        f.write('ss": 0.25}\n')
    progress.refresh()
    assert (progress.trainer["step"], progress.trainer["loss"]) == (2, 0.25)
