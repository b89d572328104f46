"""Which process runs where on a cluster, and the config each one gets.

A cluster run has `cluster.trainer_nodes` trainer nodes, each one torchrun agent with
`cluster.trainer_ranks_per_node` ranks, and `cluster.inference_nodes` inference nodes, each running
`cluster.replicas_per_node` servers: server i of a node listens on `inference.port + i` on every interface
(port 0, `asyncrl rl`'s default for any free port, means 8000 here, where ports are fixed in advance),
on a GPU of its own. The orchestrator runs on the first trainer node, and so does trainer rank 0, which
hosts torchrun's rendezvous and, with broadcast weight transfer, the broadcast group.

Only two facts are known no sooner than the job starts (on Slurm): the servers' URLs and trainer rank 0's
address. The renderers pass them as `orchestrator.inference_urls` and `weight_transfer.host`; everything
else follows from the config here, the same way for Slurm and Kubernetes.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from asyncrl.config import RLConfig
from asyncrl.config.transfer_mode import fixed_port, transfer_mode
from asyncrl.errors import AsyncRLError
from asyncrl.placement import node_device
from asyncrl.run_setup import replica_names

BIND_ALL = "0.0.0.0"  # servers are reached by their node's address, whichever interface that is on
CLUSTER_PORT = 8000  # the first inference port of a node when inference.port is 0


def run_name(cfg: RLConfig) -> str:
    """The job's name (Slurm) and the prefix of its objects (Kubernetes): `cluster.name`, or the run folder's
    name, as a DNS label (lowercase letters, digits and '-', at most 40 characters, room for suffixes)."""
    name = cfg.cluster.name or Path(cfg.output_dir).resolve().name
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:40].strip("-")
    if not label or not label[0].isalpha():
        label = f"asyncrl-{label}".strip("-")
    return label


def replica_count(cfg: RLConfig) -> int:
    return cfg.cluster.inference_nodes * cfg.cluster.replicas_per_node


def inference_port(cfg: RLConfig) -> int:
    """The port of server 0 of each inference node: inference.port, or CLUSTER_PORT for 0 (on one machine any
    free port), since on a cluster every server's port must be known in advance."""
    return cfg.inference.port or CLUSTER_PORT


def replica_port(cfg: RLConfig, index: int) -> int:
    """The port of inference server `index` (0-based over the run): port + its place on its node."""
    return inference_port(cfg) + index % cfg.cluster.replicas_per_node


def check_layout(cfg: RLConfig) -> None:
    """What a cluster run needs that a one-node run does not: ports fixed in advance."""
    if inference_port(cfg) + cfg.cluster.replicas_per_node - 1 > 65535:
        raise AsyncRLError(f"inference.port {inference_port(cfg)} leaves no room for cluster.replicas_per_node ports")
    transfer_mode(cfg.weight_transfer.mode).group_port(cfg.weight_transfer, fixed_port)


def process_configs(cfg: RLConfig) -> dict[str, BaseModel]:
    """The config of every process, by the name of its file in configs/: `inference` (or `inference_<i>`
    with several servers, i over the run in node order), `orchestrator`, `trainer`. `cfg` already holds
    the servers' URLs and trainer rank 0's address."""
    check_layout(cfg)
    cluster, deployment = cfg.cluster, cfg.deployment
    count = replica_count(cfg)
    if len(cfg.orchestrator.inference_urls) != count:
        raise AsyncRLError(
            f"orchestrator.inference_urls holds {len(cfg.orchestrator.inference_urls)} URL(s), and the cluster runs "
            f"{count} inference server(s) (cluster.inference_nodes x cluster.replicas_per_node)"
        )
    device = node_device(cluster.gpus_per_node)
    threads = max(1, deployment.inference_threads // cluster.replicas_per_node) if deployment.inference_threads else 0
    replicas = []
    for index in range(count):
        replica = cfg.inference.model_copy(deep=True)
        replica.host, replica.port = BIND_ALL, replica_port(cfg, index)
        replica.device, replica.num_threads = device, threads
        replicas.append(replica)
    orchestrator = cfg.orchestrator.model_copy(deep=True)
    orchestrator.num_trainer_ranks = cfg.trainer.rollout_files(cluster.trainer_nodes * cluster.trainer_ranks_per_node)
    trainer = cfg.trainer.model_copy(deep=True)
    trainer.device, trainer.num_threads = device, deployment.trainer_threads
    transfer_mode(cfg.weight_transfer.mode).join(replicas, [orchestrator, trainer], fixed_port)
    return {**dict(zip(replica_names(count), replicas)), "orchestrator": orchestrator, "trainer": trainer}
