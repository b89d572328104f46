"""CPU threads left at 0 are a process's share of the cores it may use, never torch's one thread per core of
the machine in every process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from asyncrl.cpu_threads import usable_cores
from asyncrl.trainer.distributed import close_distributed, init_distributed


def run_python(script: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_usable_cores_are_those_of_the_cpu_affinity():
    script = """
        import os
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        from asyncrl.cpu_threads import usable_cores
        print(usable_cores())
    """
    assert run_python(script) == "1"


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("ranks", [1, 2, 64])
def test_each_trainer_rank_takes_its_share_of_the_cores(ranks, monkeypatch, restore_threads):
    """As torchrun starts them: LOCAL_WORLD_SIZE ranks on this machine, each with num_threads = 0."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    init_distributed("cpu", 0, seed=0)
    try:
        assert torch.get_num_threads() == max(1, usable_cores() // ranks)
    finally:
        close_distributed()


@pytest.mark.parametrize("command, given, expected", [
    ("rl", None, "PASSIVE"), ("rl", "ACTIVE", "ACTIVE"), ("sft", None, "unset"), ("sft", "PASSIVE", "PASSIVE"),
])  # fmt: skip
def test_rl_makes_openmp_wait_passively_unless_the_user_chose(command, given, expected, monkeypatch):
    """Set by `asyncrl rl` before torch loads OpenMP, and inherited by every process it starts; a user's value
    stays; a command that runs alone leaves OpenMP's default."""
    if given is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", given)
    script = """
        import contextlib, io, subprocess, sys
        from asyncrl.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            main(["COMMAND", "--help"])
        assert "torch" not in sys.modules
        child = "import os; print(os.environ.get('OMP_WAIT_POLICY', 'unset'))"
        print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip())
    """
    assert run_python(script.replace("COMMAND", command)) == expected
