"""One run at a time in a run folder: the lock names its owner, refuses a second run while the owner lives,
and is taken over once the owner is gone, however it ended."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from asyncrl.errors import AsyncRLError
from asyncrl.run_lock import LOCK_NAME, RunLock

HOLDER = textwrap.dedent(
    """
    import sys, time
    from asyncrl.run_lock import RunLock
    lock = RunLock.acquire(sys.argv[1], "asyncrl rl")
    print("locked", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def holder(tmp_path):
    """Another process that holds the lock of `tmp_path` until it is killed."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "locked"
    yield process
    process.kill()
    process.wait(timeout=10)


def test_the_lock_names_its_owner(tmp_path):
    with RunLock.acquire(tmp_path, "asyncrl rl"):
        owner = json.loads((tmp_path / LOCK_NAME).read_text())
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    assert not (tmp_path / LOCK_NAME).exists(), "a run that ends gives the folder back"


def test_a_second_run_on_a_locked_folder_fails_with_one_line_naming_the_owner(tmp_path, holder):
    with pytest.raises(AsyncRLError) as refused:
        RunLock.acquire(tmp_path, "asyncrl rl")
    message = str(refused.value)
    assert "\n" not in message
    assert f"is in use by asyncrl rl (pid {holder.pid} on host {socket.gethostname()}" in message
    assert str(tmp_path / LOCK_NAME) in message


def test_the_lock_of_a_killed_owner_is_stale_and_taken_over(tmp_path, holder, capsys):
    holder.kill()  # kill -9: the owner leaves its lock file behind
    holder.wait(timeout=10)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid
    with RunLock.acquire(tmp_path, "asyncrl rl"):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    taken = f"taking over the stale lock {tmp_path / LOCK_NAME} of asyncrl rl (pid {holder.pid}"
    assert taken in capsys.readouterr().out


def test_the_same_folder_cannot_be_locked_twice_in_one_process(tmp_path):
    with RunLock.acquire(tmp_path, "asyncrl rl"):
        with pytest.raises(AsyncRLError, match="is in use by"):
            RunLock.acquire(tmp_path, "asyncrl rl")
