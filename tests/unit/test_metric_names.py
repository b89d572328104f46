"""The metric registry: every logged name has a unit and a meaning, and docs/metrics.md is rendered from it."""

from __future__ import annotations

from pathlib import Path

from asyncrl.metric_names import METRICS, describe, render


def test_metrics_reference_in_docs_is_up_to_date():
    docs = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
    assert docs.read_text() == render(), "run: python -m asyncrl.metric_names > docs/metrics.md"


def test_placeholders_match_one_path_segment():
    assert describe("reward/reverse_text/mean").name == "reward/<label>/mean"
    assert describe("reward/reverse_text/exact_match").name == "reward/<label>/<name>"
    assert describe("eval/arithmetic/pass@4").name == "eval/<label>/pass@<k>"
    assert describe("eval/arithmetic/mean/exact").name == "eval/<label>/mean/<name>"
    assert describe("reward/a/b/c") is None
    assert describe("no_such_metric") is None


def test_every_metric_has_a_unit_and_a_meaning():
    assert all(m.unit and m.meaning for m in METRICS)
    assert len({m.name for m in METRICS}) == len(METRICS)
