"""How many CPU threads each asyncrl process uses when its config says 0: its share of the usable cores.

torch's own default is one thread per core of the machine in every process, so N trainer ranks run N times
too many threads, and a container limited to 2 CPUs on a large host runs as many threads as the host has
cores. Threads that outnumber the cores wait on each other at every parallel op: on a shared 2-core machine
an SFT step took six times as long as with one thread. The usable cores are those of the process's CPU
affinity, capped by its cgroup's CPU quota (a container's `--cpus`), which torch does not read.

OpenMP's threads spin while they wait for work by default. Beside a busy neighbour on 2 shared cores that
made torch up to five times slower, and a passive wait gave the speed back; alone on the machine, the passive
wait made a small model's SFT step twice as slow (threads woken from sleep at every op). So `asyncrl rl`,
whose processes share the machine, waits passively (`passive_openmp_wait`) and a command that runs alone
keeps OpenMP's default.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def passive_openmp_wait() -> None:
    """Idle OpenMP threads sleep instead of spinning, in this process and every process it starts.

    Takes effect only before torch loads OpenMP, so `asyncrl rl`'s entry point calls it first; a value the
    user set is kept."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def threads_per_process(processes: int) -> int:
    """An equal share of the usable cores for each of `processes` processes on this machine."""
    return max(1, usable_cores() // max(1, processes))
