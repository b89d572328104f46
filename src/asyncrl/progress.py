"""Progress bars for long work (SFT steps, eval examples, checkpoints, loading a model), with elapsed time
and an ETA, drawn only on a terminal: in a log file (`asyncrl rl` children, CI) the commands print their
own lines instead, and a bar would only add control characters.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

console = Console(stderr=True, highlight=False)


class ProgressBar:
    """`description ━━━━━━ 12/100 unit elapsed 0:00:31 ETA 0:02:10 {info}`, live while open on a terminal;
    every method is a no-op elsewhere (and with `shown=False`: ranks other than 0)."""

    active: ProgressBar | None = None  # the open one: a console holds one live display at a time

    def __init__(self, description: str, total: float, completed: float = 0, unit: str = "", shown: bool = True):
        self.progress = None
        if shown and console.is_terminal:
            self.progress = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"), console=console,
            )  # fmt: skip
            self.task = self.progress.add_task(description, total=total, completed=completed, info="")
            self.progress.start()
            ProgressBar.active = self

    def advance(self, steps: float = 1, info: str | None = None) -> None:
        if self.progress is not None:
            fields = {} if info is None else {"info": info}
            self.progress.update(self.task, advance=steps, **fields)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
            ProgressBar.active = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ExpectedRemainingColumn(ProgressColumn):
    """ETA of a call that reports no progress: the time it took last time, less the time spent so far."""

    def render(self, task: Task) -> Text:
        expected = task.fields.get("expected")
        if expected is None:
            return Text("ETA ?")
        return Text(f"ETA {max(expected - (task.elapsed or 0.0), 0.0):.0f}s")


@contextmanager
def timed(description: str, expected_seconds: float | None = None, shown: bool = True) -> Iterator[None]:
    """One call that cannot report its progress (a checkpoint save, a model load): a spinner with the
    elapsed time and, from `expected_seconds` (the previous save of the same state, say), an ETA. Off a
    terminal it prints `description: N.N s` when done. `shown=False` (ranks other than 0) shows nothing."""
    if not shown:
        yield
        return
    start = time.monotonic()
    if ProgressBar.active is not None:  # inside a bar (a save between SFT steps): say it there
        ProgressBar.active.advance(0, info=f"{description}...")
        yield
        ProgressBar.active.advance(0, info=f"{description}: {time.monotonic() - start:.1f} s")
    elif console.is_terminal:
        columns = [SpinnerColumn(), TextColumn("{task.description}"), TextColumn("elapsed"), TimeElapsedColumn()]
        with Progress(*columns, ExpectedRemainingColumn(), console=console, transient=True) as progress:
            progress.add_task(description, total=None, expected=expected_seconds)
            yield
    else:
        yield
    console.print(f"{description}: {time.monotonic() - start:.1f} s", markup=False)


class Throughput:
    """Tokens per second over a window of recent steps, so one slow or fast step does not swing the figure."""

    def __init__(self, window: int = 10):
        self.steps: deque[tuple[float, float]] = deque(maxlen=window)

    def add(self, tokens: float, seconds: float) -> float:
        self.steps.append((tokens, seconds))
        return self.rate

    @property
    def rate(self) -> float:
        seconds = sum(s for _, s in self.steps)
        return sum(t for t, _ in self.steps) / seconds if seconds > 0 else 0.0
