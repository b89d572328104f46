"""Launch `asyncrl rl` again and again on a tiny model and count the launches that fail.

A start-up race (a pooled connection reused just as the inference server's keep-alive closed it) once failed
about one launch in nine with "inference server ... is not reachable (); did it stop?". This loop is the
evidence that a fix holds: many real launches, each a whole short run (inference, orchestrator, torchrun
trainer), with its exit code, its time and, for a failure, its error line.

    python benchmarks/launch_loop.py --launches 60 --budget 3600
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from asyncrl.models.offline import init_model

ARGS = [
    "--max-steps", "2", "--seq-len", "96", "--orchestrator.batch-size", "8", "--orchestrator.group-size", "4",
    "--orchestrator.sampling.max-tokens", "8", "--deployment.inference-threads", "1",
    "--deployment.trainer-threads", "1", "--deployment.inference-device", "cpu", "--deployment.trainer-device", "cpu",
]  # fmt: skip


def error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if "error" in line or "exited with code" in line]
    return (lines or output.splitlines()[-1:] or ["no output"])[-1].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=60, help="launches at most")
    parser.add_argument("--budget", type=float, default=3600, help="seconds: no launch starts after this")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one launch may take")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="asyncrl-launch-loop-"))
    model = root / "tiny"
    init_model(model, "tiny")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    start, results, failures = time.monotonic(), Counter(), []
    try:
        for launch in range(1, args.launches + 1):
            if time.monotonic() - start > args.budget:
                break
            run = root / f"run_{launch}"
            began = time.monotonic()
            try:
                result = subprocess.run(
                    [sys.executable, "-m", "asyncrl", "rl", "--model.name", str(model), "--output-dir", str(run),
                     *ARGS],  # fmt: skip
                    capture_output=True, text=True, timeout=args.timeout, env=env,
                )  # fmt: skip
                code, output = result.returncode, result.stdout + result.stderr
            except subprocess.TimeoutExpired as expired:
                code, output = "timeout", (expired.stdout or b"").decode(errors="replace")
            seconds = time.monotonic() - began
            results["ok" if code == 0 else "failed"] += 1
            if code != 0:
                failures.append(f"launch {launch}: exit {code}: {error_line(output)}")
                print(failures[-1], flush=True)
            else:
                shutil.rmtree(run, ignore_errors=True)
            print(f"launch {launch}: exit {code} in {seconds:.1f}s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = time.monotonic() - start
    launches = sum(results.values())
    print(f"{launches} launches in {total:.0f}s ({total / max(launches, 1):.1f}s each): {results['failed']} failed")
    for line in failures:
        print(f"  {line}")


if __name__ == "__main__":
    main()
