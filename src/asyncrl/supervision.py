"""The processes of a run once they start: each `Child` with its log, started so that it dies with the
launcher (processes.py); watched until the trainer finishes (`supervise`: a child that dies badly stops the
run, an inference replica only when it is the last, and a stopped, frozen process is said on the console);
stopped with every process it started; and, when one failed, its error and the checkpoint `--resume`
continues from (`report_failure`).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.live import Live

from asyncrl import checkpoints
from asyncrl.errors import AsyncRLError
from asyncrl.live_view import Progress, console
from asyncrl.processes import child_of, stop_trees, stopped_in_tree


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path

    @property
    def logs(self) -> list[Path]:
        """The child's log; for the trainer, also each rank's log (their errors land there)."""
        return [self.log, *sorted(self.log.with_suffix("").glob("rank_*.log"))]

    def tail(self, lines: int = 25) -> str:
        """The end of each of its logs."""
        parts = []
        for log in self.logs:
            text = log.read_text(errors="replace") if log.exists() else ""
            if text.strip():
                parts.append(f"--- {log}\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(parts)

    def error(self) -> str | None:
        """The one-line error an asyncrl process printed before exiting (`asyncrl trainer: error: ...`), if any."""
        for log in self.logs:
            text = log.read_text(errors="replace") if log.exists() else ""
            found = [line for line in text.splitlines() if line.startswith("asyncrl ") and ": error: " in line]
            if found:
                return found[-1]
        return None


def start(name: str, argv: list[str], log: Path, env: dict[str, str]) -> Child:
    """Start a child that dies with this process (call it from this process's only thread)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = open(log, "ab")
    # A session of its own: a Ctrl-C in the terminal reaches the launcher alone, which stops the children.
    process = subprocess.Popen(
        argv,
        stdout=handle,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=child_of(os.getpid()),
    )
    handle.close()
    return Child(name, process, log)


def stop(children: list[Child], grace: float = 10.0) -> None:
    """Stop every child with all it started (torchrun's ranks live in sessions of their own)."""
    stop_trees([c.process.pid for c in children if c.process.poll() is None], grace)
    for child in children:
        child.process.wait(timeout=10)


def wait_healthy(child: Child, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.process.poll() is not None:
            raise ChildFailed(child)
        try:
            if httpx.get(f"{url}/health", timeout=2).json().get("ready"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise AsyncRLError(f"inference server {url} not ready after {timeout:.0f}s (see {child.log})")


class ChildFailed(Exception):
    def __init__(self, child: Child, note: str = ""):
        self.child = child
        self.note = note  # what its exit means for the run, where that is more than one process gone


def say_frozen(children: list[Child], frozen: dict[str, list[int]]) -> None:
    """A process that is stopped (SIGSTOP, a debugger) neither works nor dies, so the run waits without a word:
    say so when it freezes and when it thaws."""
    for child in children:
        stopped = stopped_in_tree(child.process.pid) if child.process.poll() is None else []
        if stopped == frozen.get(child.name, []):
            continue
        if stopped:
            pids = " ".join(map(str, stopped))
            console.print(
                f"[yellow]warning:[/] {child.name} is stopped (pid {pids}: SIGSTOP or a debugger); the run waits "
                f"for it (`kill -CONT {pids}` lets it go on)",
                soft_wrap=True,
            )
        else:
            console.print(f"{child.name} runs again", soft_wrap=True)
        frozen[child.name] = stopped


def supervise(children: list[Child], progress: Progress) -> None:
    """Wait until the trainer finishes; raise ChildFailed as soon as any child dies badly. An inference
    replica may die while another lives: the orchestrator sends its groups elsewhere; the last one to die
    stops the run, with a note that no inference server is left."""
    trainer = next(c for c in children if c.name == "trainer")
    replicas = [c for c in children if c.name.startswith("inference")]
    lost: set[str] = set()
    frozen: dict[str, list[int]] = {}  # child name -> its stopped pids, as last said on the console
    polls = 0
    live = Live(progress.table(), console=console, refresh_per_second=2) if console.is_terminal else None
    if live:
        live.start()
    try:
        while True:
            for child in children:
                code = child.process.poll()
                if code is None or (code == 0 and not child.name.startswith("inference")):
                    continue
                if child.name in lost:
                    continue  # reported when it exited; the run stops on the last replica to exit
                if child in replicas and any(r.process.poll() is None for r in replicas):
                    lost.add(child.name)
                    console.print(
                        f"[yellow]{child.name} exited with code {code}[/]; the run goes on with the other "
                        f"inference servers (log: {child.log})"
                    )
                    continue
                if child in replicas and len(replicas) > 1:
                    others = ", ".join(r.name for r in replicas if r is not child)
                    raise ChildFailed(child, f"no inference server is left ({others} exited before)")
                raise ChildFailed(child)
            polls += 1
            if polls % 4 == 0:  # every 2 s: a scan of each child's process tree
                say_frozen(children, frozen)
            progress.refresh()
            if live:
                live.update(progress.table())
            elif progress.new_step():
                print(progress.line(), flush=True)
            if trainer.process.poll() == 0:
                return
            time.sleep(0.5)
    finally:
        progress.close()
        if live:
            live.update(progress.table())
            live.stop()


def resume_point(output_dir: Path) -> str:
    """Where `--resume` starts, read once every process has stopped: a process that failed named the
    checkpoint complete when it failed, and the others may have completed a newer one while they stopped."""
    try:
        step, _ = checkpoints.find_resume_step(output_dir, checkpoints.RL_PARTS, None)
    except AsyncRLError:
        return "no checkpoint is complete, so `--resume` has nothing to continue from (ckpt.interval saves them)"
    return f"now that every process has stopped, `asyncrl rl ... --resume` continues from checkpoint step {step}"


def report_failure(failed: ChildFailed, output_dir: Path) -> None:
    """Say, once every child has stopped, which one failed and why (its one-line error, or the end of its
    logs), and where `--resume` would continue."""
    child = failed.child
    error = child.error()
    exited = f"[bold red]{child.name} exited with code {child.process.returncode}[/]"
    exited += (f" ({error})" if error is not None else "") + (f"; {failed.note}" if failed.note else "")
    if error is not None:
        console.print(
            f"{exited}; stopped the others. Logs: {', '.join(str(log) for log in child.logs if log.exists())}",
            soft_wrap=True,
        )
    else:
        console.print(f"{exited}; stopped the others. Last log lines:")
        console.print(child.tail(), markup=False)
    console.print(resume_point(output_dir), soft_wrap=True)
