"""`asyncrl slurm`: the run as one sbatch script.

The script (templates/job.sbatch) derives the node addresses from Slurm's variables, prepares the shared
run folder and checks that every node sees it (run_folder.py), then starts each role with `srun`: the
inference servers on the inference nodes, one torchrun agent per trainer node (static rendezvous: the node
rank is the node's place in the step, so trainer rank 0 is on the first node, at the address the servers
are given for the weight broadcast), and the orchestrator beside it. It holds the config as given, so a
requeued job prepares the folder anew (resuming from the newest whole checkpoint).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import tomli_w

from asyncrl.clusters.layout import check_layout, inference_port, replica_count, run_name
from asyncrl.clusters.run_folder import TOKEN_ENV
from asyncrl.config import RLConfig
from asyncrl.errors import AsyncRLError

TEMPLATES = Path(__file__).parent / "templates"


def render(cfg: RLConfig, raw: dict[str, Any], clean: bool = False) -> str:
    """The sbatch script of the run `cfg`, built from `raw` (the config as given: files and flags merged)."""
    check_layout(cfg)
    cluster = cfg.cluster
    count = replica_count(cfg)
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    environment.filters["q"] = lambda value: shlex.quote(str(value))
    config = tomli_w.dumps(raw)
    if "\nASYNCRL_CONFIG\n" in f"\n{config}":
        raise AsyncRLError("the config holds a line 'ASYNCRL_CONFIG', which ends the script's copy of it; rename it")
    nodes = cluster.trainer_nodes + cluster.inference_nodes
    return environment.get_template("job.sbatch").render(
        name=run_name(cfg),
        nodes=nodes,
        trainer_span=_span(1, cluster.trainer_nodes),
        inference_span=_span(cluster.trainer_nodes + 1, nodes),
        trainer_nodes=cluster.trainer_nodes,
        inference_nodes=cluster.inference_nodes,
        ranks_per_node=cluster.trainer_ranks_per_node,
        replicas_per_node=cluster.replicas_per_node,
        gpus_per_node=cluster.gpus_per_node,
        rendezvous_port=cluster.rendezvous_port,
        folder_timeout=int(cluster.folder_timeout),
        port=inference_port(cfg),
        output_dir=Path(cfg.output_dir).absolute(),
        workdir=Path.cwd(),
        python=cluster.slurm.python or sys.executable,
        sbatch=_sbatch_options(cfg),
        setup=cluster.slurm.setup,
        config=config,
        prepare_flags="--clean" if clean else "",
        token_env=TOKEN_ENV,
        inference_config="inference" if count == 1 else "inference_$SLURM_PROCID",
        inference_log="inference" if count == 1 else "inference_%t",
    )


def _span(first: int, last: int) -> str:
    return f"node {first}" if first == last else f"nodes {first}-{last}"


def _sbatch_options(cfg: RLConfig) -> list[str]:
    slurm = cfg.cluster.slurm
    named = {"--partition": slurm.partition, "--account": slurm.account, "--time": slurm.time}
    return [f"{flag}={value}" for flag, value in named.items() if value] + list(slurm.sbatch)


def submit(script: str) -> str:
    """Submit the script with sbatch (read from its standard input); returns sbatch's answer."""
    try:
        result = subprocess.run(["sbatch"], input=script, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise AsyncRLError(
            "sbatch not found: run --submit on a Slurm login node, or save the script and submit it there"
        ) from None
    if result.returncode != 0:
        raise AsyncRLError(f"sbatch refused the script: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout.strip()
