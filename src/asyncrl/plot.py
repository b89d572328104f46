"""`asyncrl plot RUN [RUN ...] --out DIR`: PNGs of the standard curves (the dashboard's panels) of runs.

One PNG per panel that has data (`reward.png`, `loss.png`, ...), every run of the command on it, and
`overview.png` with all of them in a grid: the picture an example's README shows.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from asyncrl.dashboard.panels import PANELS, chart_of, unit_of
from asyncrl.errors import AsyncRLError
from asyncrl.metrics import read_jsonl

Series = dict[tuple[str, str, str], dict[int, float]]  # (run, source, metric) -> step -> value


def read_series(runs: list[Path]) -> Series:
    series: Series = {}
    for run in runs:
        path = run / "metrics.jsonl"
        if not path.is_file():
            raise AsyncRLError(f"'{path}' not found (give run folders: the output_dir of asyncrl rl or sft)")
        for record in read_jsonl(path):
            for name, value in record.items():
                if name not in ("step", "source", "time") and isinstance(value, int | float):
                    series.setdefault((run.name, record["source"], name), {})[record["step"]] = value
    return series


def file_name(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_") + ".png"


def _draw(ax, title: str, lines: list[tuple[str, dict[int, float]]], unit: str) -> None:
    for label, points in lines:
        steps = sorted(points)
        ax.plot(steps, [points[s] for s in steps], label=label, linewidth=1.2, marker="o" if len(steps) < 30 else None)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel(unit, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_runs(runs: list[Path], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AsyncRLError("asyncrl plot needs matplotlib: pip install 'asyncrl[plot]'") from None
    series = read_series(runs)
    several = len(runs) > 1
    panels: dict[str, list[tuple[str, dict[int, float]]]] = {}
    units: dict[str, str] = {}
    sources: dict[str, set[str]] = {}
    for _, source, name in series:
        sources.setdefault(name, set()).add(source)
    for (run, source, name), points in sorted(series.items()):
        title = chart_of(name)
        if title not in {p.title for p in PANELS}:
            continue
        label = (f"{run}: " if several else "") + name + (f" ({source})" if len(sources[name]) > 1 else "")
        panels.setdefault(title, []).append((label, points))
        units.setdefault(title, unit_of(name))
    if not panels:
        raise AsyncRLError(f"no standard metrics in {', '.join(str(r / 'metrics.jsonl') for r in runs)}")
    out.mkdir(parents=True, exist_ok=True)
    ordered = [p.title for p in PANELS if p.title in panels]
    written = []
    for title in ordered:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        _draw(ax, title, panels[title], units[title])
        fig.tight_layout()
        fig.savefig(out / file_name(title), dpi=110)
        plt.close(fig)
        written.append(out / file_name(title))
    columns = min(3, len(ordered))
    rows = math.ceil(len(ordered) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.2 * rows), squeeze=False)
    for ax, title in zip(axes.flat, ordered):
        _draw(ax, title, panels[title], units[title])
    for ax in list(axes.flat)[len(ordered) :]:
        ax.axis("off")
    fig.suptitle(", ".join(r.name for r in runs), fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(out / "overview.png", dpi=100)
    plt.close(fig)
    return [*written, out / "overview.png"]
