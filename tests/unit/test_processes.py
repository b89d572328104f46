"""Processes of a run live and die together: a child dies with its parent however the parent ends, and a
stopped child takes everything it started with it, also what it put in sessions of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

# A parent that starts a child the way the launcher does, prints the child's pid, then waits to be killed.
PARENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from asyncrl.processes import child_of
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                             preexec_fn=child_of(os.getpid()))
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_child_dies_at_once_when_its_parent_is_killed_with_sigkill():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert psutil.Process(child).is_running()
        parent.kill()  # no handler, no cleanup: only the kernel can stop the child now
        parent.wait(timeout=10)
        assert gone_within(child, 2.0), "the child outlived its parent"
    finally:
        parent.kill()


def test_a_child_whose_parent_is_already_gone_dies_at_start():
    """The parent may die between starting the child and the child asking to die with it."""
    script = "from asyncrl.processes import die_with_parent; die_with_parent(1); print('still alive')"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGKILL and "still alive" not in result.stdout


def test_stopping_a_child_stops_a_grandchild_in_a_session_of_its_own():
    """As torchrun starts its ranks: a signal to the child's process group alone would miss them."""
    from asyncrl.processes import stop_trees, tree

    script = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
        "time.sleep(120)"
    )
    child = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(tree(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        [_, grandchild] = tree(child.pid)
        assert os.getsid(grandchild.pid) != os.getsid(child.pid)
        stop_trees([child.pid], grace=5)
        assert child.wait(timeout=10) == -signal.SIGTERM  # not reaped by stop_trees: Popen keeps the code
        assert gone_within(grandchild.pid, 5.0)
    finally:
        child.kill()


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period():
    from asyncrl.processes import stop_trees

    script = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
        "time.sleep(120)"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        start = time.monotonic()
        stop_trees([child.pid], grace=1.0)
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert 1.0 <= time.monotonic() - start < 8.0
    finally:
        child.kill()
