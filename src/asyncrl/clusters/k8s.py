"""`asyncrl k8s`: the run as Kubernetes manifests.

    <name>-run            PersistentVolumeClaim (ReadWriteMany): the shared run folder; every pod works in it
    <name>-secrets        Secret: the admin token of the servers' /admin routes and their API key
    <name>-config         ConfigMap: the config as given (rl.toml), every process's config, the run's token
    <name>-inference      headless Service + StatefulSet: one pod per inference node, one container per server
    <name>-trainer        headless Service + indexed Job: one pod per trainer node, one torchrun agent each
    <name>-orchestrator   Job: prepares the run folder (an init container), then runs the orchestrator

The orchestrator addresses each server by its pod's name (`<name>-inference-<n>.<name>-inference`), since it
routes groups and brings weights to every server on its own: a load-balancing Service would hide them.
The trainer's pods find each other through torchrun's static rendezvous on pod 0 (the node rank is the
Job's completion index), so trainer rank 0 is on pod 0, where the servers join the weight broadcast.
Every pod but the orchestrator's first waits, in an init container, until it sees the run folder's token.
"""

from __future__ import annotations

import copy
import secrets
from pathlib import PurePosixPath
from typing import Any

import tomli_w
import yaml

from asyncrl.clusters.layout import inference_port, process_configs, replica_count, replica_port, run_name
from asyncrl.clusters.run_folder import TOKEN_ENV
from asyncrl.config import RLConfig, to_toml
from asyncrl.config.loader import build, deep_merge, share_rl_keys
from asyncrl.config.transfer_mode import transfer_mode
from asyncrl.errors import AsyncRLError

CONFIG_PATH = "/etc/asyncrl"


class Manifests:
    """The objects of one run; `cfg` is the config as built, `raw` as given (files and flags merged)."""

    def __init__(self, cfg: RLConfig, raw: dict[str, Any], clean: bool = False):
        self.k8s = cfg.cluster.k8s
        if not self.k8s.image:
            raise AsyncRLError("cluster.k8s.image is not set (the container image that has asyncrl installed)")
        self.name = run_name(cfg)
        self.clean = clean
        volume = PurePosixPath(self.k8s.volume_path)
        output_dir = PurePosixPath(cfg.output_dir)
        if output_dir.is_absolute() and volume not in (output_dir, *output_dir.parents):
            raise AsyncRLError(
                f"output_dir '{output_dir}' is not on the shared volume mounted at {volume} "
                "(make it relative, or set cluster.k8s.volume_path)"
            )
        self.output_dir = str(output_dir)
        # Known in advance on Kubernetes: every server's URL and trainer rank 0's address.
        self.trainer_head = f"{self.name}-trainer-0.{self.name}-trainer"
        self.raw = deep_merge(
            copy.deepcopy(raw),
            {"orchestrator": {"inference_urls": self._urls(cfg)}, "weight_transfer": {"host": self.trainer_head}},
        )
        self.cfg = build(RLConfig, share_rl_keys(copy.deepcopy(self.raw)))
        self.configs = process_configs(self.cfg)

    def _urls(self, cfg: RLConfig) -> list[str]:
        per_node = cfg.cluster.replicas_per_node
        return [
            f"http://{self.name}-inference-{i // per_node}.{self.name}-inference:{replica_port(cfg, i)}"
            for i in range(replica_count(cfg))
        ]

    def objects(self) -> list[dict[str, Any]]:
        return [
            self.claim(),
            self.secret(),
            self.config_map(),
            self.service("inference", self._inference_ports()),
            self.inference(),
            self.service("trainer", self._trainer_ports()),
            self.trainer(),
            self.orchestrator(),
        ]

    def render(self) -> str:
        return yaml.dump_all(self.objects(), Dumper=_Dumper, sort_keys=False)

    # ---- metadata and the pieces every pod shares ----

    def metadata(self, suffix: str, component: str | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": f"{self.name}-{suffix}", "labels": self.labels(component)}
        if self.k8s.namespace:
            meta["namespace"] = self.k8s.namespace
        return meta

    def labels(self, component: str | None = None) -> dict[str, str]:
        labels = {"app.kubernetes.io/name": "asyncrl", "app.kubernetes.io/instance": self.name}
        if component:
            labels["app.kubernetes.io/component"] = component
        return labels

    def volumes(self, shared_memory: bool) -> list[dict[str, Any]]:
        volumes = [
            {"name": "run", "persistentVolumeClaim": {"claimName": f"{self.name}-run"}},
            {"name": "config", "configMap": {"name": f"{self.name}-config"}},
        ]
        if shared_memory:  # torch and NCCL need more than the container runtime's 64 MiB of /dev/shm
            volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
        return volumes

    def mounts(self, shared_memory: bool) -> list[dict[str, Any]]:
        mounts = [
            {"name": "run", "mountPath": self.k8s.volume_path},
            {"name": "config", "mountPath": CONFIG_PATH, "readOnly": True},
        ]
        if shared_memory:
            mounts.append({"name": "shm", "mountPath": "/dev/shm"})
        return mounts

    def env(self, *secrets_: str) -> list[dict[str, Any]]:
        env: list[dict[str, Any]] = [
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": TOKEN_ENV, "valueFrom": {"configMapKeyRef": {"name": f"{self.name}-config", "key": "run-token"}}},
        ]
        for variable, key in (("ASYNCRL_ADMIN_TOKEN", "admin-token"), ("ASYNCRL_API_KEY", "api-key")):
            if key in secrets_:
                env.append(
                    {"name": variable, "valueFrom": {"secretKeyRef": {"name": f"{self.name}-secrets", "key": key}}}
                )
        return env

    def container(self, name: str, command: list[str], shared_memory: bool = False, **extra: Any) -> dict[str, Any]:
        return {
            "name": name,
            "image": self.k8s.image,
            "workingDir": self.k8s.volume_path,
            "command": command,
            "volumeMounts": self.mounts(shared_memory),
            **extra,
        }

    def folder_check(self) -> dict[str, Any]:
        """An init container that waits until the pod sees the run folder the orchestrator's pod prepared."""
        timeout = str(int(self.cfg.cluster.folder_timeout))
        command = ["asyncrl", "run-folder", "check", self.output_dir, "--timeout", timeout]
        return self.container("run-folder-check", command, env=self.env())

    def gpus(self, count: int) -> dict[str, Any]:
        if not self.cfg.cluster.gpus_per_node:
            return {}
        return {"resources": {"limits": {self.k8s.gpu_resource: count}}}

    # ---- the objects ----

    def claim(self) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": self.k8s.storage}},
        }
        if self.k8s.storage_class:
            spec["storageClassName"] = self.k8s.storage_class
        return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": self.metadata("run"), "spec": spec}

    def secret(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": self.metadata("secrets"),
            "type": "Opaque",
            "stringData": {"admin-token": secrets.token_hex(16), "api-key": secrets.token_hex(16)},
        }

    def config_map(self) -> dict[str, Any]:
        data = {"rl.toml": tomli_w.dumps(self.raw), "run-token": secrets.token_hex(16)}
        data.update({f"{name}.toml": to_toml(config) for name, config in self.configs.items()})
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": self.metadata("config"), "data": data}

    def service(self, component: str, ports: list[dict[str, Any]]) -> dict[str, Any]:
        """Headless: a DNS name per pod, published before the pod is ready (the peers wait on their own)."""
        spec = {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": self.labels(component),
            "ports": ports,
        }
        return {"apiVersion": "v1", "kind": "Service", "metadata": self.metadata(component, component), "spec": spec}

    def _inference_ports(self) -> list[dict[str, Any]]:
        port = inference_port(self.cfg)
        return [{"name": f"http-{i}", "port": port + i} for i in range(self.cfg.cluster.replicas_per_node)]

    def _trainer_ports(self) -> list[dict[str, Any]]:
        ports = [{"name": "rendezvous", "port": self.cfg.cluster.rendezvous_port}]
        transfer = transfer_mode(self.cfg.weight_transfer.mode).trainer_ports(self.cfg.weight_transfer.port)
        return ports + [{"name": name, "port": port} for name, port in transfer]

    def inference(self) -> dict[str, Any]:
        per_node = self.cfg.cluster.replicas_per_node
        single = replica_count(self.cfg) == 1
        containers = []
        for local in range(per_node):
            # The pod's ordinal ends its hostname (<name>-inference-<n>); server n x per_node + local is this one.
            config = "inference" if single else f"inference_$(( ${{HOSTNAME##*-}} * {per_node} + {local} ))"
            command = ["sh", "-c", f'exec asyncrl inference @ "{CONFIG_PATH}/{config}.toml"']
            port = inference_port(self.cfg) + local
            containers.append(
                self.container(
                    f"inference-{local}",
                    command,
                    shared_memory=True,
                    env=self.env("admin-token", "api-key"),
                    ports=[{"name": f"http-{local}", "containerPort": port}],
                    readinessProbe={"httpGet": {"path": "/health", "port": port}, "periodSeconds": 5},
                    **self.gpus(1),
                )
            )
        pod = {
            "metadata": {"labels": self.labels("inference")},
            "spec": {
                "initContainers": [self.folder_check()],
                "containers": containers,
                "volumes": self.volumes(shared_memory=True),
            },
        }
        spec = {
            "serviceName": f"{self.name}-inference",
            "replicas": self.cfg.cluster.inference_nodes,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": self.labels("inference")},
            "template": pod,
        }
        metadata = self.metadata("inference", "inference")
        return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata, "spec": spec}

    def trainer(self) -> dict[str, Any]:
        cluster = self.cfg.cluster
        torchrun = (
            f"exec torchrun --nnodes={cluster.trainer_nodes} --nproc-per-node={cluster.trainer_ranks_per_node} "
            f'--node-rank="$JOB_COMPLETION_INDEX" --rdzv-endpoint={self.trainer_head}:{cluster.rendezvous_port} '
            f'-m asyncrl trainer @ "{CONFIG_PATH}/trainer.toml"'
        )
        env = [*self.env(), {"name": "ASYNCRL_RANK_LOG_DIR", "value": f"{self.output_dir}/logs/trainer"}]
        container = self.container(
            "trainer",
            ["sh", "-c", torchrun],
            shared_memory=True,
            env=env,
            ports=[{"name": "rendezvous", "containerPort": cluster.rendezvous_port}],
            **self.gpus(cluster.trainer_ranks_per_node),
        )
        pod = {
            "metadata": {"labels": self.labels("trainer")},
            "spec": {
                "subdomain": f"{self.name}-trainer",  # pod n answers at <name>-trainer-<n>.<name>-trainer
                "restartPolicy": "Never",
                "initContainers": [self.folder_check()],
                "containers": [container],
                "volumes": self.volumes(shared_memory=True),
            },
        }
        spec = {
            "completionMode": "Indexed",
            "completions": cluster.trainer_nodes,
            "parallelism": cluster.trainer_nodes,
            "backoffLimit": 0,
            "template": pod,
        }
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": self.metadata("trainer", "trainer"), "spec": spec}

    def orchestrator(self) -> dict[str, Any]:
        prepare = ["asyncrl", "run-folder", "prepare", "@", f"{CONFIG_PATH}/rl.toml"]
        if self.clean:
            prepare.append("--clean")
        orchestrate = ["asyncrl", "orchestrator", "@", f"{CONFIG_PATH}/orchestrator.toml"]
        pod = {
            "metadata": {"labels": self.labels("orchestrator")},
            "spec": {
                "restartPolicy": "Never",
                "initContainers": [self.container("prepare-run-folder", prepare, env=self.env())],
                "containers": [self.container("orchestrator", orchestrate, env=self.env("admin-token", "api-key"))],
                "volumes": self.volumes(shared_memory=False),
            },
        }
        spec = {"backoffLimit": 0, "template": pod}
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": self.metadata("orchestrator", "orchestrator"),
            "spec": spec,
        }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the TOML files of the ConfigMap) as literal blocks, readable as they are."""

    def represent_str(self, data: str) -> yaml.ScalarNode:
        return self.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_Dumper.add_representer(str, _Dumper.represent_str)


def render(cfg: RLConfig, raw: dict[str, Any], clean: bool = False) -> str:
    return Manifests(cfg, raw, clean).render()
