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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_torchrun_rank_whose_agent_is_already_gone_ends_before_its_imports():
    """The agent killed right after it started a rank: the rank, orphaned before it could ask to die with it,
    finds its parent is no longer a Python process and ends; under a living Python parent it runs."""
    rank = (
        "import os, sys, time; time.sleep(float(sys.argv[1])); os.environ['TORCHELASTIC_RUN_ID'] = 'x'; "
        "sys.argv = ['asyncrl', '--help']; import asyncrl.__main__"
    )
    # The would-be agent starts the rank and is gone at once; the rank's start takes a second.
    agent = f"import os, subprocess, sys; subprocess.Popen([sys.executable, '-c', {rank!r}, '1']); os._exit(0)"
    result = subprocess.run([sys.executable, "-c", agent], capture_output=True, text=True, timeout=60)
    # The rank shares the pipe: run() returns when the rank, too, has closed it (ended).
    assert "usage: asyncrl" not in result.stdout
    living = subprocess.run([sys.executable, "-c", rank, "0"], capture_output=True, text=True, timeout=60)
    assert living.returncode == 0 and "usage: asyncrl" in living.stdout


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


def test_a_stopped_process_in_a_tree_is_found_until_it_continues():
    from asyncrl.processes import stopped_in_tree

    sleeper = "import time; time.sleep(60)"
    script = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {sleeper!r}]); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 30
        while len(psutil.Process(child.pid).children()) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        [grandchild] = psutil.Process(child.pid).children()
        assert stopped_in_tree(child.pid) == []
        os.kill(grandchild.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not stopped_in_tree(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stopped_in_tree(child.pid) == [grandchild.pid]
        os.kill(grandchild.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while stopped_in_tree(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stopped_in_tree(child.pid) == []
    finally:
        for process in psutil.Process(child.pid).children(recursive=True):
            process.kill()
        child.kill()
        child.wait(timeout=10)
