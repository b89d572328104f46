"""`asyncrl eval`: environments' held-out examples against a served model, scored as avg@n and pass@k.

Writes `<output_dir>/results.jsonl` (one line per rollout), `<output_dir>/summary.json`, and prints the
summary as a table. The server is `inference_url` (`asyncrl inference`, vLLM, or any OpenAI API), or, when
that is unset, an `asyncrl inference` process started here for `model.name` and stopped afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.table import Table

from asyncrl.config.schema import EvalConfig
from asyncrl.errors import AsyncRLError
from asyncrl.evals.metrics import summarize
from asyncrl.evals.routes import ChatRoute, OpenAIServer, TokenRoute
from asyncrl.evals.run import evaluate, load_eval_environments
from asyncrl.metrics import JsonlWriter
from asyncrl.progress import ProgressBar


@contextmanager
def inference_server(cfg: EvalConfig) -> Iterator[str]:
    """The URL of the server to evaluate: `inference_url`, or an `asyncrl inference` process for `model.name`
    started on a free loopback port (log: output_dir/inference.log) and stopped when the eval ends."""
    if cfg.inference_url is not None:
        yield cfg.inference_url
        return
    from asyncrl.cpu_threads import threads_per_process
    from asyncrl.loading import check_model_name
    from asyncrl.run_setup import free_port
    from asyncrl.supervision import ChildFailed, start, stop, wait_healthy

    check_model_name(cfg.model.name)
    port = free_port()
    threads = cfg.server.num_threads or threads_per_process(2)
    argv = [sys.executable, "-m", "asyncrl", "inference", "--model.name", cfg.model.name, "--port", str(port),
            "--seq-len", str(cfg.server.seq_len), "--device", cfg.server.device, "--num-threads", str(threads),
            "--seed", "0", *cfg.server.args]  # fmt: skip
    log = Path(cfg.output_dir) / "inference.log"
    log.unlink(missing_ok=True)
    child = start("inference", argv, log, {**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        print(f"eval: starting asyncrl inference for {cfg.model.name} on {url} (log: {log})", flush=True)
        try:
            wait_healthy(child, url, cfg.server.startup_timeout)
        except ChildFailed:
            last = child.tail(5).splitlines()[-1:] or ["no output"]
            raise AsyncRLError(
                f"the inference server for {cfg.model.name} exited with code {child.process.returncode}: "
                f"{last[0]} (see {log})"
            ) from None
        yield url
    finally:
        stop([child])


async def _run(cfg: EvalConfig, url: str) -> dict:
    envs = load_eval_environments(cfg.environments)
    server = OpenAIServer(url, cfg.model.name, cfg.request_timeout)
    client = None
    try:
        max_model_len = await server.wait_ready(cfg.wait_timeout)
        api = cfg.api
        if api == "auto":
            api = "generate" if await server.has_generate_route() else "chat"
        if api == "generate":
            from asyncrl.loading import load_tokenizer
            from asyncrl.orchestrator.client import InferenceClient, ServedPolicy

            client = InferenceClient(url, None, cfg.request_timeout)
            route = TokenRoute(ServedPolicy(client, load_tokenizer(cfg.model.name), cfg.sampling, max_model_len))
        else:
            route = ChatRoute(server, cfg.sampling)
        output_dir = Path(cfg.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "results.jsonl").unlink(missing_ok=True)
        results = JsonlWriter(output_dir / "results.jsonl")
        summaries = {}
        for label, env in envs.items():
            start = time.time()
            with ProgressBar(f"eval {label}", cfg.environments[label].num_examples, unit="examples") as bar:
                samples = await evaluate(env, label, cfg.environments[label], cfg, route, bar)
            for sample in samples:
                results.write(dataclasses.asdict(sample))
            summaries[label] = summarize(samples, cfg.samples_per_example, cfg.pass_ks)
            summaries[label]["seconds"] = time.time() - start
    finally:
        await server.close()
        if client is not None:
            await client.close()
    summary = {
        "model": cfg.model.name,
        "inference_url": cfg.inference_url,  # None: a server started for this eval
        "api": api,
        "samples_per_example": cfg.samples_per_example,
        "pass_at": cfg.pass_ks,
        "environments": summaries,
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def summary_table(summary: dict) -> Table:
    n, ks = summary["samples_per_example"], summary["pass_at"]
    table = Table(title=f"asyncrl eval: {summary['model']} ({summary['api']} route)")
    columns = ["environment", "examples", f"avg@{n}", *(f"pass@{k}" for k in ks), "errored", "truncated"]
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    for label, s in summary["environments"].items():
        table.add_row(
            label,
            str(s["examples"]),
            f"{s[f'avg@{n}']:.3f}",
            *(f"{s[f'pass@{k}']:.3f}" for k in ks),
            str(s["errored"]),
            str(s["truncated"]),
        )
    return table


def run_eval(cfg: EvalConfig) -> int:
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    with inference_server(cfg) as url:
        summary = asyncio.run(_run(cfg, url))
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 120)
    console.print(summary_table(summary))
    seconds = sum(s["seconds"] for s in summary["environments"].values())
    console.print(f"{seconds:.1f}s; wrote {Path(cfg.output_dir) / 'results.jsonl'} and summary.json")
    return 0
