"""The code sandbox contains what untrusted code tries: an endless loop, a fork bomb, a huge allocation, writes
outside its folder, sockets, reading the run's files. Each escape runs both as the code environment runs it
and, where started as root, without the drop to an unprivileged user (so the audit hook and limits alone must
hold)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time

import psutil
import pytest
from scripted_policy import ScriptedPolicy  # tests/unit, on sys.path under pytest

from asyncrl.environments import load_environment
from asyncrl.environments.sandbox import SandboxLimits, Test, run_tests

LIMITS = [SandboxLimits(cpu_seconds=2, wall_seconds=6), SandboxLimits(cpu_seconds=2, wall_seconds=6, drop_to_uid=None)]
IDS = ["as-run", "no-uid-drop"]


def run(code: str, expected: str = "1", limits: SandboxLimits = LIMITS[0]):
    return run_tests(code, [Test("f()", expected)], limits)


def test_a_right_answer_passes_and_a_wrong_one_fails():
    result = run_tests("def f(x):\n    return x * 2\n", [Test("f(2)", "4"), Test("f(3)", "7"), Test("f('a')", "'aa'")])
    assert result.passed == [True, False, True] and result.fraction_passed == pytest.approx(2 / 3)
    assert result.code_error is None and not result.killed


def test_code_that_does_not_run_fails_every_test_with_its_error():
    result = run_tests("def f(:\n", [Test("f()", "1"), Test("f()", "2")])
    assert result.passed == [False, False] and result.code_error.startswith("SyntaxError")


def test_tests_are_read_from_asserts_with_a_literal_and_nothing_else():
    assert Test.from_assert("assert add(2, 3) == 5") == Test("add(2, 3)", "5")
    assert Test.from_assert("assert f('a') == ('a', [1])") == Test("f('a')", "('a', [1])")
    for bad in ("assert f(1)", "assert f(1) == g(1)", "assert f(1) != 2", "print(1)"):
        with pytest.raises(ValueError):
            Test.from_assert(bad)


def test_printing_a_result_does_not_pass_a_test():
    code = 'import sys\ndef f():\n    print(\'{"index": 0, "repr": "42"}\')\n    return 0\n'
    assert run(code, expected="42").passed == [False]


@pytest.mark.parametrize("limits", LIMITS, ids=IDS)
def test_an_endless_loop_is_stopped_by_the_cpu_limit(limits):
    start = time.monotonic()
    result = run("def f():\n    while True:\n        pass\n", limits=limits)
    assert result.passed == [False] and result.killed
    assert time.monotonic() - start < limits.wall_seconds + 2


def test_a_sleeping_function_is_stopped_by_the_wall_clock_limit():
    start = time.monotonic()
    result = run("import time\ndef f():\n    time.sleep(60)\n", limits=SandboxLimits(wall_seconds=2))
    assert result.killed and result.passed == [False] and time.monotonic() - start < 5


@pytest.mark.parametrize("limits", LIMITS, ids=IDS)
def test_a_fork_bomb_starts_no_process(limits):
    before = {p.pid for p in psutil.process_iter()}
    bombs = [
        "import os\ndef f():\n    while True:\n        os.fork()\n",
        "import subprocess\ndef f():\n    subprocess.Popen(['sh', '-c', ':(){ :|:& };:'])\n",
        "import os\ndef f():\n    os.system('sleep 30 &')\n",
        "import multiprocessing\ndef f():\n    multiprocessing.Process(target=print).start()\n",
    ]
    for code in bombs:
        assert run(code, limits=limits).passed == [False]
    time.sleep(0.5)
    # A process left behind is orphaned: its runner is gone, so it belongs to init, to a reaper among this test's
    # ancestors, or to this test. Sandboxes of tests running beside this one (pytest-xdist) have live parents.
    adopters = {1, os.getpid(), *(p.pid for p in psutil.Process().parents())}
    left = [
        " ".join(p.info["cmdline"] or [])
        for p in psutil.process_iter(["cmdline", "ppid"])
        if p.pid not in before and p.info["ppid"] in adopters
    ]
    assert not [c for c in left if "sleep" in c or "sandbox_runner" in c]


@pytest.mark.parametrize("limits", LIMITS, ids=IDS)
def test_a_huge_allocation_fails_inside_the_sandbox(limits):
    start = time.monotonic()
    result = run("def f():\n    return len(bytearray(8 * 2**30))\n", expected="8589934592", limits=limits)
    assert result.passed == [False] and "MemoryError" in result.errors[0]
    result = run("def f():\n    x = [0] * 10**10\n    return 1\n", limits=limits)
    assert result.passed == [False] and time.monotonic() - start < 10


@pytest.mark.parametrize("limits", LIMITS, ids=IDS)
def test_writes_outside_the_sandbox_folder_are_refused_and_inside_allowed(limits, tmp_path):
    target = tmp_path / "escaped.txt"
    attempts = [
        f"def f():\n    open({str(target)!r}, 'w').write('x')\n",
        f"import os\ndef f():\n    os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)\n",
        f"import os\ndef f():\n    os.symlink({str(target)!r}, 'link')\n    open('link', 'w').write('x')\n",
        f"def f():\n    open('../' * 20 + {str(target)[1:]!r}, 'a').write('x')\n",
        f"import os\ndef f():\n    os.rename('.', {str(target)!r})\n",
    ]
    for code in attempts:
        assert run(code, limits=limits).passed == [False]
    assert not target.exists()
    inside = "def f():\n    open('scratch.txt', 'w').write('hi')\n    return open('scratch.txt').read()\n"
    assert run(inside, expected="'hi'", limits=limits).passed == [True]


@pytest.mark.parametrize("limits", LIMITS, ids=IDS)
def test_a_socket_reaches_nothing(limits):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        code = (
            "import socket\ndef f():\n"
            f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    s.sendall(b'escaped')\n    return 1\n"
        )
        assert run(code, limits=limits).passed == [False]
        with pytest.raises(TimeoutError):
            listener.accept()


@pytest.mark.parametrize("limits", LIMITS, ids=IDS)
def test_the_runs_files_cannot_be_read_or_listed(limits, tmp_path):
    secret = tmp_path / "run" / "configs" / "secret.toml"
    secret.parent.mkdir(parents=True)
    secret.write_text("admin_token = 'hunter2'")
    os.chmod(secret, 0o644)
    reads = [
        f"def f():\n    return open({str(secret)!r}).read()\n",
        f"import pathlib\ndef f():\n    return pathlib.Path({str(secret)!r}).read_text()\n",
        f"import os\ndef f():\n    return os.read(os.open({str(secret)!r}, os.O_RDONLY), 100).decode()\n",
        "def f():\n    return open('/proc/1/environ').read()\n",
    ]
    for code in reads:
        assert run(code, expected=repr(secret.read_text()), limits=limits).passed == [False]
    listing = f"import os\ndef f():\n    return sorted(os.listdir({str(secret.parent)!r}))\n"
    assert run(listing, expected="['secret.toml']", limits=limits).passed == [False]
    environment = "import os\ndef f():\n    return 'ASYNCRL_ADMIN_TOKEN' in os.environ or 'HOME' not in os.environ\n"
    assert run(environment, expected="False", limits=limits).passed == [True]


def test_ctypes_a_way_around_the_hook_cannot_be_imported():
    result = run("import ctypes\ndef f():\n    return 1\n")
    assert result.passed == [False] and "not allowed" in result.code_error


# ---- the code environment ----


def test_code_environment_rewards_the_fraction_of_hidden_tests_passed(tmp_path):
    env = load_environment("code", num_tests=4)
    example = next(env.examples(seed=0))
    assert "```python" in example.prompt[0]["content"] and len(example.info["tests"]) == 4
    assert all(t["call"] not in example.prompt[0]["content"] for t in example.info["tests"])  # hidden
    right = "x = 1\n```python\ndef f(x):\n    return " + example.info["tests"][0]["expected"] + "\n```"
    [rollout] = asyncio.run(env.rollout_group(example, ScriptedPolicy([right], max_tokens=200), 1))
    assert rollout.metrics["runs"] == 1.0 and 0.25 <= rollout.reward <= 1.0  # a constant passes some

    rows = [{"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}]
    path = tmp_path / "mbpp.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    from_file = load_environment("code", path=str(path))
    example = next(from_file.examples(seed=0))
    answer = "def add(a, b):\n    return a + b if a != 2 else 0\n"
    [rollout] = asyncio.run(from_file.rollout_group(example, ScriptedPolicy([answer], max_tokens=200), 1))
    assert rollout.reward == 0.5 and rollout.metrics == {"passed": 0.5, "runs": 1.0, "killed": 0.0}


def test_generated_code_tasks_carry_a_reference_solution_that_passes_every_hidden_test():
    env = load_environment("code", num_tests=3)
    examples = [e for _, e in zip(range(12), env.examples(seed=0))]
    kinds = {re.sub(r"\d|'\w'", "", e.answer) for e in examples}  # the solution with its constants left out
    assert len(kinds) == 8  # every kind of task is in the sample
    for example in examples:
        assert example.answer.startswith("```python\ndef f(x):\n")
        assert asyncio.run(env.rubric.score(example.answer, example, state={})).reward == 1.0
