"""What `asyncrl rl` decides and checks before any process starts: the config of each process (its port, its
device from placement.py, its threads, its place in the weight transfer), and everything that can be found
wrong first (preflight.py, and the inference ports free).
"""

from __future__ import annotations

import socket
from pathlib import Path

from asyncrl import preflight
from asyncrl.config import InferenceConfig, OrchestratorConfig, RLConfig, TrainerConfig
from asyncrl.config.schema import DeploymentConfig
from asyncrl.config.transfer_mode import transfer_mode
from asyncrl.cpu_threads import usable_cores
from asyncrl.errors import AsyncRLError
from asyncrl.live_view import console
from asyncrl.loading import check_model
from asyncrl.placement import Placement, place, visible_gpus


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def replica_names(count: int) -> list[str]:
    """Config and log names of the inference servers: `inference` alone, or `inference_0`, `inference_1`, ..."""
    return ["inference"] if count == 1 else [f"inference_{i}" for i in range(count)]


def resolve(cfg: RLConfig, gpus: int | None = None) -> tuple[list[InferenceConfig], OrchestratorConfig, TrainerConfig]:
    """Per-process configs: shared keys are already copied by the loader; here the deployment decides
    ports, devices (placement.py, among `gpus`: those visible if None) and threads, one inference config per
    replica."""
    dep = cfg.deployment
    orchestrator = cfg.orchestrator.model_copy(deep=True)
    trainer = cfg.trainer.model_copy(deep=True)
    placed = placement(dep, gpus)
    problem = transfer_mode(cfg.weight_transfer.mode).placement_problem(placed.inference, placed.trainer[0])
    if problem:
        raise AsyncRLError(problem)
    trainer.device = placed.trainer_device
    cores = usable_cores()
    inference_threads = dep.inference_threads or max(1, cores // 2)
    replicas = []
    for i, device in enumerate(placed.inference):
        replica = cfg.inference.model_copy(deep=True)
        replica.device = device
        replica.num_threads = max(1, inference_threads // len(placed.inference))
        replica.port = free_port(replica.host) if cfg.inference.port == 0 else cfg.inference.port + i
        replicas.append(replica)
    orchestrator.inference_urls = [f"http://{r.host}:{r.port}" for r in replicas]
    transfer_mode(cfg.weight_transfer.mode).join(replicas, [orchestrator, trainer], free_port)
    orchestrator.num_trainer_ranks = trainer.rollout_files(dep.trainer_ranks)
    trainer.num_threads = dep.trainer_threads or max(1, (cores - inference_threads) // dep.trainer_ranks)
    return replicas, orchestrator, trainer


def placement(dep: DeploymentConfig, gpus: int | None = None) -> Placement:
    """The device of every replica and trainer rank among `gpus` (None: those torch sees, counted only when
    a device other than the CPU is asked for)."""
    if gpus is None:
        gpus = 0 if dep.inference_device == dep.trainer_device == "cpu" else visible_gpus()
    return place(dep.inference_device, dep.trainer_device, dep.inference_replicas, dep.trainer_ranks, gpus)


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        # As the server binds: connections of a run that just ended (TIME_WAIT) do not make the port busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise AsyncRLError(
                f"port {port} on {host} is in use (set inference.port, or 0 for any free port)"
            ) from None


def check_before_start(cfg: RLConfig, replicas: list[InferenceConfig], orchestrator: OrchestratorConfig,
                       trainer: TrainerConfig) -> None:  # fmt: skip
    """Everything that can be found wrong before a process starts (preflight.py)."""
    preflight.check_output_dir(Path(cfg.output_dir))
    crowded = preflight.cpu_oversubscription(replicas, trainer, cfg.deployment.trainer_ranks, usable_cores())
    if crowded:
        console.print(f"[yellow]warning:[/] {crowded}", soft_wrap=True)
    tokenizer = check_model(cfg.model.name)
    environments = preflight.local_environments(orchestrator)
    preflight.online_eval_environments(orchestrator)
    for warning in preflight.check_prompt_lengths(environments, tokenizer, orchestrator):
        console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
    for replica in replicas:
        check_port_free(replica.host, replica.port)
