"""A server under hostile load: does a good client still get its answer, and does /health stay quick?

    python benchmarks/hostile_load.py                      # tiny model, CPU, the defaults below
    python benchmarks/hostile_load.py --hostile 200 --leavers 8 --repeats 3

A real `asyncrl inference` process (a tiny model built offline, `--device cpu`, one torch thread) is measured
twice, side by side in one run:

    idle     good requests one after another, /health probed every 50 ms
    hostile  the same, while --hostile clients each send one chat body just under the server's
             `max_request_bytes` (half of them one long text, half thousands of short messages, whose chat
             template takes a prompt thread long to render), and --leavers clients send a body of
             many short messages and leave after --leave-after seconds, mid-rendering

A good request is a one-message chat completion of --good-tokens greedy tokens. The phase ends when every
hostile client has its answer (each a 400: too long for `seq_len`) and at least --min-good good answers are in.
Goals (on an idle machine): a good request answered in at most 2 s, /health in at most 100 ms, both at their
worst over the hostile phase, as seen from a process of its own (the good client and the /health prober share
it; the crowd's sends would delay them in the crowd's event loop). Each repeat starts a fresh server for each
setting of --chat-processes (by default 0, the server's own threads preparing large chat bodies, and 2 worker
processes), interleaved; the table shows the median of the repeats' figures per setting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

GOOD = {"messages": [{"role": "user", "content": "reverse: hello"}], "temperature": 0.0}
GOAL_GOOD_S, GOAL_HEALTH_S = 2.0, 0.1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def long_text_body(size: int) -> bytes:
    """One user message whose JSON body is just under `size` bytes."""
    frame = json.dumps({"messages": [{"role": "user", "content": ""}]})
    return json.dumps(
        {"messages": [{"role": "user", "content": "abcdefgh " * ((size - len(frame) - 16) // 9)}]}
    ).encode()


def many_messages_body(size: int) -> bytes:
    """As many short user messages as fit just under `size` bytes: slow to validate and to render."""
    one = len(json.dumps({"role": "user", "content": "hi"})) + 2
    count = (size - 32) // one
    return json.dumps({"messages": [{"role": "user", "content": "hi"}] * count}).encode()


def start_server(model: Path, port: int, args: argparse.Namespace, chat_processes: int, log: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "asyncrl", "inference", "--model.name", str(model), "--port", str(port),
        "--seq-len", str(args.seq_len), "--num-threads", "1", "--device", "cpu",
        "--max-request-bytes", str(args.max_request_bytes), "--chat-processes", str(chat_processes),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json().get("ready"):
                return process
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"the server did not answer /health within 120 s; see {log}")


async def probe_health(client: httpx.AsyncClient, until: asyncio.Event, latencies: list[float]) -> None:
    while not until.is_set():
        started = time.perf_counter()
        response = await client.get("/health")
        latencies.append(time.perf_counter() - started)
        assert response.status_code == 200, response.text
        await asyncio.sleep(0.05)


async def good_requests(client: httpx.AsyncClient, until: asyncio.Event, tokens: int, latencies: list[float]) -> None:
    while not until.is_set():
        started = time.perf_counter()
        response = await client.post("/v1/chat/completions", json={**GOOD, "max_tokens": tokens})
        latencies.append(time.perf_counter() - started)
        assert response.status_code == 200, response.text


async def watch(url: str, tokens: int, min_good: int, crowd_done, started, results) -> None:
    """The good client and the /health prober, until the crowd is done and `min_good` answers are in."""
    health: list[float] = []
    good: list[float] = []
    done = asyncio.Event()
    async with (
        httpx.AsyncClient(base_url=url, timeout=600) as prober,
        httpx.AsyncClient(base_url=url, timeout=600) as polite,
    ):
        watchers = [
            asyncio.create_task(probe_health(prober, done, health)),
            asyncio.create_task(good_requests(polite, done, tokens, good)),
        ]
        started.set()
        while not (crowd_done.is_set() and len(good) >= min_good):
            await asyncio.sleep(0.05)
        done.set()
        await asyncio.gather(*watchers)
    results.put((health, good))


def watcher_process(url: str, tokens: int, min_good: int, crowd_done, started, results) -> None:
    asyncio.run(watch(url, tokens, min_good, crowd_done, started, results))


async def phase(url: str, args: argparse.Namespace, hostile: int, leavers: int) -> dict:
    """One phase: good requests and /health probes beside `hostile` + `leavers` clients (module docstring).
    The good client and the prober run in a process of their own, as a load balancer's health check does:
    in this one, the crowd's 400 MB of sends would delay them in the client's own event loop."""
    bodies = [long_text_body(args.max_request_bytes), many_messages_body(args.max_request_bytes)]
    statuses: Counter = Counter()
    limits = httpx.Limits(max_connections=hostile + leavers + 8)
    headers = {"content-type": "application/json"}

    async def one_hostile(client: httpx.AsyncClient, body: bytes) -> None:
        statuses[(await client.post("/v1/chat/completions", content=body, headers=headers)).status_code] += 1

    async def one_leaver(client: httpx.AsyncClient) -> None:
        try:
            await client.post("/v1/chat/completions", content=bodies[1], headers=headers, timeout=args.leave_after)
            statuses["answered before leaving"] += 1
        except httpx.TimeoutException:
            statuses["left"] += 1

    context = multiprocessing.get_context("spawn")
    crowd_done, started, results = context.Event(), context.Event(), context.Queue()
    watcher = context.Process(
        target=watcher_process, args=(url, args.good_tokens, args.min_good, crowd_done, started, results)
    )
    watcher.start()
    try:
        if not await asyncio.to_thread(started.wait, 60):
            raise SystemExit("the watcher process did not start within 60 s")
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as crowd:
            began = time.perf_counter()
            crowd_tasks = [one_hostile(crowd, bodies[i % 2]) for i in range(hostile)]
            crowd_tasks += [one_leaver(crowd) for _ in range(leavers)]
            await asyncio.gather(*crowd_tasks)
            crowd_s = time.perf_counter() - began
            crowd_done.set()
            health, good = await asyncio.to_thread(results.get, True, 600)
            counters = (
                "asyncrl_inference_prompts_stopped_total ",
                "asyncrl_inference_chat_process_bodies_stopped_total ",
            )
            stopped = sum(
                float(line.split()[-1]) for line in (await crowd.get("/metrics")).text.splitlines()
                if line.startswith(counters)
            )  # fmt: skip
    finally:
        crowd_done.set()
        watcher.join(30)
        if watcher.is_alive():
            watcher.kill()
    return {
        "good_p50": statistics.median(good),
        "good_max": max(good),
        "good_count": len(good),
        "health_p50": statistics.median(health),
        "health_p99": sorted(health)[int(0.99 * (len(health) - 1))],
        "health_max": max(health),
        "crowd_s": crowd_s,
        "statuses": dict(statuses),
        "prompts_stopped": stopped,
    }


def main() -> None:
    from asyncrl.models.offline import init_model  # not at the top: the spawned watcher must not import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hostile", type=int, default=200, help="clients sending a body just under the limit")
    parser.add_argument("--leavers", type=int, default=8, help="clients that leave while their prompt is rendered")
    parser.add_argument("--leave-after", type=float, default=0.5, help="seconds before a leaver hangs up")
    parser.add_argument("--max-request-bytes", type=int, default=2 * 2**20, help="the server's body limit")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--good-tokens", type=int, default=16, help="greedy tokens per good request")
    parser.add_argument("--min-good", type=int, default=5, help="good answers measured at least, per phase")
    parser.add_argument("--repeats", type=int, default=3, help="fresh servers, each measured idle then hostile")
    parser.add_argument(
        "--chat-processes",
        default="0,2",
        help="server settings of inference.chat_processes to compare, each on fresh servers (0: the server's threads)",
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    settings = [int(value) for value in args.chat_processes.split(",")]
    runs: dict[int, list[dict[str, dict]]] = {setting: [] for setting in settings}
    with tempfile.TemporaryDirectory() as scratch:
        model = Path(scratch) / "tiny"
        init_model(model, "tiny", seed=0)
        for repeat in range(args.repeats):
            for setting in settings:  # interleaved, so that a noisy minute hurts both alike
                port = free_port()
                server = start_server(model, port, args, setting, Path(scratch) / f"server_{repeat}_{setting}.log")
                try:
                    url = f"http://127.0.0.1:{port}"
                    idle = asyncio.run(phase(url, args, 0, 0))
                    hostile = asyncio.run(phase(url, args, args.hostile, args.leavers))
                finally:
                    server.terminate()
                    server.wait(30)
                runs[setting].append({"idle": idle, "hostile": hostile})
                print(
                    f"repeat {repeat + 1}, chat_processes {setting}: hostile clients' answers {hostile['statuses']}, "
                    f"{hostile['crowd_s']:.1f} s; prompts stopped {hostile['prompts_stopped']:g}; good requests "
                    f"{hostile['good_count']}",
                    flush=True,
                )

    def median(setting: int, name: str, key: str) -> float:
        return statistics.median(run[name][key] for run in runs[setting])

    print(
        f"\n{args.hostile} hostile clients (bodies just under {args.max_request_bytes:,} bytes) + {args.leavers} that"
        f" leave after {args.leave_after:g} s; seq_len {args.seq_len}; median of {args.repeats} fresh servers each"
    )
    print(
        f"{'chat_processes':<15} {'phase':<9} {'good p50':>9} {'good max':>9} {'health p50':>11} {'health p99':>11} "
        f"{'health max':>11}"
    )
    for setting in settings:
        for name in ("idle", "hostile"):
            print(
                f"{setting:<15} {name:<9} {median(setting, name, 'good_p50'):>8.3f}s "
                f"{median(setting, name, 'good_max'):>8.3f}s {median(setting, name, 'health_p50') * 1000:>9.1f}ms "
                f"{median(setting, name, 'health_p99') * 1000:>9.1f}ms "
                f"{median(setting, name, 'health_max') * 1000:>9.1f}ms"
            )
    for setting in settings:
        good, health = median(setting, "hostile", "good_max"), median(setting, "hostile", "health_max")
        print(
            f"chat_processes {setting}, goals under load: good request <= {GOAL_GOOD_S:g} s: {good:.3f} s "
            f"({'met' if good <= GOAL_GOOD_S else 'NOT met'}); /health <= {GOAL_HEALTH_S * 1000:g} ms: "
            f"{health * 1000:.1f} ms ({'met' if health <= GOAL_HEALTH_S else 'NOT met'})"
        )


if __name__ == "__main__":
    main()
