"""The run folder of a cluster run: one folder, on a filesystem that every node mounts at the same path.

Before any process starts, `prepare` runs once, on one node: it makes the folder ready (a new run; or, with
`resume` or after a requeue, the run rewound to its newest whole checkpoint, as `asyncrl rl --resume` does),
writes each process's config into configs/, and last writes the job's random token to RUN_TOKEN. Then
`check` runs on every node and waits until it reads that same token there. A node that mounts another
folder at that path, or none, stops the job with one line that says so, before anything is trained or
generated: without this, a trainer rank would wait for rollout files that are written elsewhere.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from asyncrl import checkpoints
from asyncrl.clusters.layout import process_configs
from asyncrl.config import RLConfig, write_toml
from asyncrl.config.schema import ResumeConfig
from asyncrl.errors import AsyncRLError
from asyncrl.launcher import prepare_output_dir, resume_run
from asyncrl.transport.waiting import PeerTimeout, wait_for

TOKEN_FILE = "RUN_TOKEN"
TOKEN_ENV = "ASYNCRL_RUN_TOKEN"  # how the job hands its token to every node


def job_token() -> str:
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise AsyncRLError(f"{TOKEN_ENV} is not set (the job script or manifest sets it to a random token per job)")
    return token


def prepare(cfg: RLConfig, clean: bool = False, requeued: bool = False) -> int | None:
    """Make the run folder ready and write configs/; returns the checkpoint step the run resumes from, if any.
    A requeued job resumes from its newest whole checkpoint, or starts over when it has none yet."""
    output_dir = Path(cfg.output_dir)
    step = None
    if requeued and _has_whole_checkpoint(output_dir):
        step = resume_run(output_dir, None, cfg.max_steps, clean=False)
    elif requeued:
        print(f"requeued before the first checkpoint: starting {output_dir} over", flush=True)
        prepare_output_dir(output_dir, clean=True)
    elif cfg.resume is not None:
        step = resume_run(output_dir, cfg.resume.step, cfg.max_steps, clean)
    else:
        prepare_output_dir(output_dir, clean)
    configs = process_configs(cfg)
    for name in ("orchestrator", "trainer"):
        configs[name].resume = ResumeConfig(step=step) if step is not None else None
    for name, config in configs.items():
        write_toml(config, output_dir / "configs" / f"{name}.toml")
    write_toml(cfg, output_dir / "configs" / "rl.toml")
    mark(output_dir, job_token())
    return step


def _has_whole_checkpoint(output_dir: Path) -> bool:
    try:
        checkpoints.find_resume_step(output_dir, checkpoints.RL_PARTS, None)
    except AsyncRLError:
        return False
    return True


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
