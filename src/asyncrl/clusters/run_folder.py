"""The run folder of a cluster run is one folder, on a filesystem that every node mounts at the same path.

The job gives every node a random token (ASYNCRL_RUN_TOKEN). Once the folder is prepared (prepare.py), its
token is written to RUN_TOKEN, last; then `check` runs on every node and waits until it reads that same token
there. A node that mounts another folder at that path, or none, stops the job with one line that says so,
before anything is trained or generated: without this, a trainer rank would wait for rollout files that
are written elsewhere. The check runs before anything else on every node, so this module imports no torch.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from asyncrl.errors import AsyncRLError
from asyncrl.transport.waiting import PeerTimeout, wait_for

TOKEN_FILE = "RUN_TOKEN"
TOKEN_ENV = "ASYNCRL_RUN_TOKEN"  # how the job hands its token to every node


def job_token() -> str:
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise AsyncRLError(f"{TOKEN_ENV} is not set (the job script or manifest sets it to a random token per job)")
    return token


def mark(output_dir: Path, token: str) -> None:
    """Write the token last, atomically: a node that reads it sees a folder ready to run in."""
    path = Path(output_dir) / TOKEN_FILE
    tmp = path.with_name(f".{TOKEN_FILE}.tmp{os.getpid()}")
    tmp.write_text(token + "\n")
    os.replace(tmp, path)


def read_token(output_dir: Path) -> str | None:
    try:
        return (Path(output_dir) / TOKEN_FILE).read_text().strip()
    except OSError:
        return None


def check(output_dir: Path, token: str, timeout: float) -> None:
    """Wait until the run folder holds this job's token; raise, naming this node and what it saw, if not."""
    folder = Path(output_dir).resolve()
    try:
        wait_for(lambda: read_token(folder) == token, timeout, "the run folder's token", poll=0.5)
    except PeerTimeout:
        seen = read_token(folder)
        what = f"no {TOKEN_FILE}" if seen is None else f"another job's {TOKEN_FILE}"
        raise AsyncRLError(
            f"node {socket.gethostname()} sees {what} in the run folder {folder} after {timeout:.0f}s: it does not "
            "see the folder the job prepared on its first node (put output_dir on a filesystem that every node "
            "mounts at the same path)"
        ) from None
