"""A torch.profiler trace of a few steps of a running loop: the trainer's steps, the orchestrator's batches,
the inference server's policy versions (a step ends when a weight update goes live).

The profiler lets `wait` steps run untraced (start-up, compilation), traces `warmup` steps and throws them
away (its own start-up costs), then keeps `active` steps in one Chrome trace (open it in Perfetto or
chrome://tracing). Steps count from the process's start: a resumed run's from its first step after the
checkpoint.

Every thread is traced, not only the loop's: the orchestrator packs and writes batches and runs sync reward
functions in worker threads, the trainer writes weight folders in one, and the server answers HTTP on others
than its decoding thread.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from asyncrl.config.schema import ProfileConfig


def all_threads() -> dict:
    """The profiler's option to trace every thread, where torch has it; an older torch traces the thread that
    starts the profiler and the threads it starts."""
    try:
        return {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except TypeError:
        return {}


class StepProfiler:
    """Call `step()` at the end of every step and `stop()` after the last; a no-op without `cfg.dir`. On
    `device_type` cuda the GPU's kernels are traced too. `python_calls`: record every Python call as well, for
    a process whose time goes to Python rather than to torch ops (the orchestrator); it slows the traced
    steps."""

    def __init__(self, cfg: ProfileConfig, name: str, device_type: str = "cpu", python_calls: bool = False):
        self.trace = None if cfg.dir is None else Path(cfg.dir) / f"{name}.json"
        self._profiler = None
        if self.trace is None:
            return
        self.trace.parent.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
        self._profiler = profile(
            activities=activities,
            schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
            on_trace_ready=self._write,
            with_stack=python_calls,
            **all_threads(),
        )
        self._profiler.start()

    def _write(self, profiler: profile) -> None:
        profiler.export_chrome_trace(str(self.trace))
        print(f"profile: {self.trace} (Chrome trace: open it in Perfetto)", flush=True)

    def step(self) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def stop(self) -> None:
        """End profiling; a trace still recording is written with the steps it holds."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
