"""A real `asyncrl inference` process for the tests that talk to one: started, awaited healthy, stopped."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def inference_command(model_dir: Path, port: int, *flags: str) -> list[str]:
    model = ["--model.name", str(model_dir), "--port", str(port), "--num-threads", "1"]
    return [sys.executable, "-m", "asyncrl", "inference", *model, *flags]


@contextmanager
def running_server(
    command: list[str], port: int, log_path: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> Iterator[str]:
    """Yield the server's URL once /health answers; a server that exits or stays unhealthy fails the test."""
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if process.poll() is not None:
                    pytest.fail(f"inference server exited with {process.returncode}; see {log_path}")
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"inference server not healthy after {timeout:.0f}s; see {log_path}")
                time.sleep(0.1)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
