"""The processes of a run live and die together.

- A child dies with its parent. On Linux the kernel kills it (SIGKILL) the moment its parent exits, however
  the parent went (`kill -9` included): `die_with_parent` asks for that (prctl PR_SET_PDEATHSIG). Elsewhere a
  thread watches the parent and ends the process when it is gone. The launcher asks for it in every child
  it starts, before the child's program runs; a process started by torchrun asks for it itself, at start,
  before its imports (`die_with_torchrun_agent`), since torchrun starts its ranks in sessions of their own and
  does not stop them when it is killed; if the agent is already gone by then, the rank ends at once.
- A stopped child takes its whole tree with it: `stop_trees` signals every descendant, not only the child's
  process group, so ranks that torchrun put in sessions of their own are reached too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

import psutil

PR_SET_PDEATHSIG = 1
# Resolved once, here: a preexec function runs between fork and exec, where loading a library is unsafe.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(parent_pid: int | None = None) -> None:
    """Be killed as soon as the parent process exits. With `parent_pid`, the parent this process must have:
    if it was already gone when this was called (this process then has another parent), die now."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    else:
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="parent watch").start()
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_torchrun_agent() -> None:
    """For a rank torchrun started: die with the agent, and die now if the agent was killed before this ran
    (in the moments between its starting this process and here). An orphan's new parent is init (pid 1) or a
    subreaper, not a Python process; so a parent that is pid 1 or does not run Python means the agent is gone.
    `python -m asyncrl` calls this first thing, before its imports."""
    die_with_parent()
    if not _may_be_an_agent(os.getppid()):
        os.kill(os.getpid(), signal.SIGKILL)


def _may_be_an_agent(pid: int) -> bool:
    if pid <= 1:
        return False
    try:
        process = psutil.Process(pid)
        command = " ".join(process.cmdline())
        return "python" in process.name().lower() or "torchrun" in command or "python" in command.lower()
    except psutil.Error:
        return False


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def child_of(parent_pid: int):
    """A `preexec_fn` for `subprocess.Popen`: the child dies with `parent_pid` (the process starting it).
    Only for a parent with a single thread, as every preexec_fn."""
    return lambda: die_with_parent(parent_pid)


def under_torchrun() -> bool:
    """Whether this process is a worker that torchrun started."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants that are still running (parents first)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def stopped_in_tree(pid: int) -> list[int]:
    """The pids of the process's tree that are stopped (SIGSTOP, SIGTSTP, a debugger): frozen, not dead."""
    stopped = []
    for process in tree(pid):
        try:
            if process.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                stopped.append(process.pid)
        except psutil.Error:
            continue
    return stopped


def stop_trees(pids: list[int], grace: float) -> None:
    """SIGTERM each process and its descendants, wait up to `grace` seconds for them to exit, then SIGKILL
    what is left. Exited children are not reaped here: their `Popen` keeps its exit code."""
    processes = [p for pid in pids for p in tree(pid)]
    _signal(processes, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (alive := [p for p in processes if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal(alive, signal.SIGKILL)


def _signal(processes: list[psutil.Process], signum: int) -> None:
    for process in processes:
        try:
            process.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
