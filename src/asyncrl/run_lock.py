"""One run at a time in a run folder: `<output_dir>/run.lock`.

The process that owns the folder (`asyncrl rl`, `asyncrl sft`) holds an exclusive `flock` on the lock file
for as long as it lives, and writes into it who it is (command, process id, host, start time). A second run
or resume on the folder fails with one line naming the owner, before it touches anything. The kernel drops
the lock when its holder exits, however it exits (`kill -9`, a crash): a lock file that no process holds is
stale, and the next run takes it over.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from asyncrl.errors import AsyncRLError

LOCK_NAME = "run.lock"


class RunLock:
    """Held from `acquire` until `release` (or this process's end)."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, output_dir: Path, command: str) -> RunLock:
        """Lock `output_dir` for `command` (`asyncrl rl`), or raise AsyncRLError naming the owner."""
        path = Path(output_dir) / LOCK_NAME
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read(fd)
                os.close(fd)
                raise AsyncRLError(
                    f"output_dir '{output_dir}' is in use by {_describe(owner)} (lock: {path}); stop that run "
                    "first, or set output_dir to another folder"
                ) from None
            # The holder before us may have deleted the file on release after we opened it: then we hold an
            # unlinked file, and must lock the one at `path` instead.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = _read(fd)
        if stale:
            print(f"taking over the stale lock {path} of {_describe(stale)}, which is no longer running", flush=True)
        record = {
            "command": command,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Delete the lock file and drop the lock (in this order: see `acquire`)."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 65536, 0) or b"{}")
    except ValueError:
        return {}


def _describe(owner: dict) -> str:
    if not owner:
        return "another process"
    return f"{owner.get('command')} (pid {owner.get('pid')} on host {owner.get('host')}, since {owner.get('since')})"
