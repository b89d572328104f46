"""`asyncrl eval`: environments' held-out examples against a served model, scored as avg@n and pass@k.

Writes `<output_dir>/results.jsonl` (one line per rollout), `<output_dir>/summary.json`, and prints the
summary as a table. The server is started separately: `asyncrl inference`, vLLM, or any OpenAI API.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from asyncrl.config.schema import EvalConfig, EvalEnvironmentConfig, EvalSuiteConfig
from asyncrl.environments import load_environment
from asyncrl.environments.base import Environment
from asyncrl.evals.metrics import EvalSample, summarize
from asyncrl.evals.routes import ChatRoute, OpenAIServer, TokenRoute
from asyncrl.metrics import JsonlWriter


def load_eval_environments(environments: dict[str, EvalEnvironmentConfig]) -> dict[str, Environment]:
    return {label: load_environment(env.name or label, **env.args) for label, env in environments.items()}


async def evaluate(
    env: Environment, label: str, env_cfg: EvalEnvironmentConfig, suite: EvalSuiteConfig, route: TokenRoute | ChatRoute
) -> list[EvalSample]:
    """n samples of each of the environment's first `num_examples` eval examples, `max_concurrency`
    examples in flight."""
    limit = asyncio.Semaphore(suite.max_concurrency)
    examples = itertools.islice(env.eval_examples(), env_cfg.num_examples)

    async def one(index: int, example) -> list[EvalSample]:
        async with limit:
            return await route.play(env, label, index, example, suite.samples_per_example, env_cfg.pass_threshold)

    groups = await asyncio.gather(*(one(i, e) for i, e in enumerate(examples)))
    return [s for group in groups for s in group]


async def _run(cfg: EvalConfig) -> dict:
    envs = load_eval_environments(cfg.environments)
    server = OpenAIServer(cfg.inference_url, cfg.model.name, cfg.request_timeout)
    client = None
    try:
        max_model_len = await server.wait_ready(cfg.wait_timeout)
        api = cfg.api
        if api == "auto":
            api = "generate" if await server.has_generate_route() else "chat"
        if api == "generate":
            from asyncrl.loading import load_tokenizer
            from asyncrl.orchestrator.client import InferenceClient, ServedPolicy

            client = InferenceClient(cfg.inference_url, None, cfg.request_timeout)
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
            samples = await evaluate(env, label, cfg.environments[label], cfg, route)
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
        "inference_url": cfg.inference_url,
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
    summary = asyncio.run(_run(cfg))
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 120)
    console.print(summary_table(summary))
    seconds = sum(s["seconds"] for s in summary["environments"].values())
    console.print(f"{seconds:.1f}s; wrote {Path(cfg.output_dir) / 'results.jsonl'} and summary.json")
    return 0
