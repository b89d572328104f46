"""What the dashboard reads from run folders while a run writes them (asyncrl/dashboard/runs.py)."""

from __future__ import annotations

import json

import pytest

from asyncrl.dashboard.runs import SampleIndex, find_runs, log_tail, read_lines


def test_metric_lines_are_read_from_an_offset_whole_lines_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    first = read_lines(path, 0)
    assert [r["step"] for r in first.records] == [1, 2] and not first.reset
    with open(path, "a") as f:
        f.write('ss": 1.0}\n')
    second = read_lines(path, first.offset)
    assert second.records == [{"step": 3, "loss": 1.0}]
    assert read_lines(path, second.offset).records == []


def test_a_rewound_file_is_read_again_from_the_start(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    offset = read_lines(path, 0).offset
    path.write_text('{"step": 1}\n')  # `asyncrl rl --resume` rewound the run to step 1
    chunk = read_lines(path, offset)
    assert chunk.reset and chunk.records == [{"step": 1}]


def test_runs_are_found_by_their_files_directly_or_one_level_down(tmp_path):
    for name in ("a", "b"):
        (tmp_path / "outputs" / name).mkdir(parents=True)
        (tmp_path / "outputs" / name / "metrics.jsonl").touch()
    (tmp_path / "outputs" / "not_a_run").mkdir()
    assert list(find_runs([tmp_path / "outputs"])) == ["a", "b"]
    assert find_runs([tmp_path / "outputs" / "b"]) == {"b": tmp_path / "outputs" / "b"}


def test_only_the_runs_own_logs_can_be_read(tmp_path):
    (tmp_path / "logs" / "trainer").mkdir(parents=True)
    (tmp_path / "logs" / "trainer" / "rank_0.log").write_text("".join(f"line {i}\n" for i in range(500)))
    assert log_tail(tmp_path, "trainer/rank_0.log", 2) == "line 498\nline 499"
    for name in ("../metrics.jsonl", "/etc/passwd"):
        with pytest.raises(KeyError):
            log_tail(tmp_path, name)


def test_the_sample_index_reads_one_steps_lines_as_the_file_grows(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps({"step": s, "env": e}) + "\n" for s, e in [(1, "a"), (1, "b"), (2, "a")]))
    index = SampleIndex(path)
    assert index.steps() == [1, 2]
    assert [r["env"] for r in index.records(1)] == ["a", "b"]
    with open(path, "a") as f:
        f.write(json.dumps({"step": 3, "env": "c"}) + "\n")
    assert index.steps() == [1, 2, 3] and index.records(3) == [{"step": 3, "env": "c"}]
