"""Run untrusted Python (a model's answer) against hidden tests, contained.

`run_tests(code, tests)` starts `sandbox_runner.py` in a fresh temporary folder, with an empty environment
(no API keys or tokens of the run), in a session of its own, and gives it the code and each test's call
expression only: the expected values stay here, so the code cannot read them, and printing cannot fake a
pass. The runner locks itself down before the code runs (network namespace, unprivileged user when started as
root, resource limits, an audit hook: see its docstring). Here, a wall-clock limit kills the whole session,
and the folder is deleted afterwards. A test passes when the call's value, read back from its repr with
`ast.literal_eval`, equals the expected value.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

RUNNER = Path(__file__).with_name("sandbox_runner.py")
NOBODY = 65534


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 2  # CPU time of the whole run (RLIMIT_CPU)
    wall_seconds: float = 10.0  # then the session is killed (sleeps and blocked reads use no CPU)
    memory_mb: int = 512  # address space (RLIMIT_AS)
    file_size_mb: int = 1  # largest file it may write (RLIMIT_FSIZE)
    open_files: int = 64  # RLIMIT_NOFILE
    max_processes: int = 32  # RLIMIT_NPROC of the unprivileged user, when started as root
    max_output: int = 10_000  # characters of a value's repr read back
    drop_to_uid: int | None = NOBODY  # as root: the user the code runs as (None: stay root)


@dataclass(frozen=True)
class Test:
    """`call` is evaluated in the sandbox; its value must equal `expected` (a Python literal, kept here)."""

    __test__ = False  # not a pytest test class

    call: str
    expected: str

    @staticmethod
    def from_assert(line: str) -> Test:
        """`assert f(3) == 7`-style tests (MBPP's form) as a call and the literal it must equal."""
        try:
            statement = ast.parse(line.strip()).body
        except SyntaxError:
            statement = []
        if (
            len(statement) != 1
            or not isinstance(statement[0], ast.Assert)
            or not isinstance(statement[0].test, ast.Compare)
            or [type(op) for op in statement[0].test.ops] != [ast.Eq]
        ):
            raise ValueError(f"test {line!r} is not of the form 'assert <call> == <literal>'")
        compare = statement[0].test
        expected = ast.unparse(compare.comparators[0])
        ast.literal_eval(expected)  # raises ValueError when it is not a literal
        return Test(ast.unparse(compare.left), expected)


@dataclass
class SandboxResult:
    passed: list[bool]
    errors: list[str | None]  # per test: why it failed, when it did not just give another value
    code_error: str | None = None  # the code itself failed to run (syntax error, exception at top level)
    killed: bool = False  # the wall-clock limit (or a limit's signal) ended the run
    network: str = ""  # how the network was closed: "namespace" or "audit hook"

    @property
    def fraction_passed(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


def _equal(value_repr: str, expected: str) -> bool:
    try:
        return ast.literal_eval(value_repr) == ast.literal_eval(expected)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False


def run_tests(code: str, tests: list[Test], limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    drop = limits.drop_to_uid if os.geteuid() == 0 else None
    folder = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
    try:
        if drop is not None:
            os.chown(folder, drop, drop)
        request = {"code": code, "calls": [t.call for t in tests], "limits": {**asdict(limits), "drop_to_uid": drop}}
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", str(RUNNER)],
            cwd=folder,
            env={"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # one process group: the kill below reaches whatever it started
        )
        killed = False
        try:
            output, _ = process.communicate(json.dumps(request).encode(), timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            killed = True
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        try:
            os.killpg(process.pid, signal.SIGKILL)  # anything it left behind in its session
        except ProcessLookupError:
            pass
        killed = killed or process.returncode < 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    lines = []
    for raw in output.decode(errors="replace").splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            continue
    header = lines[0] if lines and "network" in lines[0] else {}
    code_error = next((line["error"] for line in lines if "error" in line and "index" not in line), None)
    by_index = {line["index"]: line for line in lines if isinstance(line.get("index"), int)}
    passed, errors = [], []
    for index, test in enumerate(tests):
        line = by_index.get(index, {"error": code_error or ("killed" if killed else "no result")})
        ok = "repr" in line and _equal(line["repr"], test.expected)
        passed.append(ok)
        errors.append(None if ok or "repr" in line else line["error"])
    return SandboxResult(passed, errors, code_error, killed, header.get("network", ""))
