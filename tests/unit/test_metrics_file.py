"""metrics.jsonl is read while processes append to it: a half-written last record waits for the next read."""

from __future__ import annotations

from asyncrl.metrics import JsonlWriter, read_jsonl


def test_a_record_still_being_written_is_left_for_the_next_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    JsonlWriter(path).write({"step": 1, "loss": 0.5})
    with path.open("a") as file:
        file.write('{"step": 2, "lo')  # what a reader sees in the middle of the writer's append
    assert read_jsonl(path) == [{"step": 1, "loss": 0.5}]
    with path.open("a") as file:
        file.write('ss": 0.25}\n')
    assert read_jsonl(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []
