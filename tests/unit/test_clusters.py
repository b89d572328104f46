"""Cluster runs: the layout of processes over nodes, the shared run folder, the sbatch script and the Kubernetes
manifests (validated against the Kubernetes API schemas, offline)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from asyncrl.clusters import k8s, run_folder, slurm
from asyncrl.clusters.commands import load_as_given
from asyncrl.clusters.layout import process_configs
from asyncrl.clusters.prepare import prepare
from asyncrl.config import ConfigError, RLConfig, load
from asyncrl.errors import AsyncRLError

URLS = '["http://a:8000", "http://a:8001", "http://b:8000", "http://b:8001"]'
TWO_BY_TWO = ["--cluster.inference-nodes", "2", "--cluster.replicas-per-node", "2", "--cluster.trainer-nodes", "3",
              "--cluster.trainer-ranks-per-node", "2", "--orchestrator.inference-urls", URLS]  # fmt: skip
KUBERNETES_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())  # the oldest we claim, and the newest


def cluster(*flags: str) -> RLConfig:
    return load(RLConfig, [*TWO_BY_TWO, *flags])[0]


def test_port_0_the_default_of_asyncrl_rl_for_any_free_port_is_8000_on_a_cluster():
    servers = [c for name, c in process_configs(cluster()).items() if name.startswith("inference")]
    assert [s.port for s in servers] == [8000, 8001, 8000, 8001]


def test_server_i_of_a_node_listens_on_port_plus_i_on_every_interface():
    configs = process_configs(cluster("--inference.port", "9000"))
    servers = [configs[f"inference_{i}"] for i in range(4)]
    assert [s.port for s in servers] == [9000, 9001, 9000, 9001]
    assert {s.host for s in servers} == {"0.0.0.0"}
    assert {s.device for s in servers} == {"cpu"}
    assert configs["orchestrator"].inference_urls == tomllib.loads(f"u = {URLS}")["u"]
    assert configs["orchestrator"].num_trainer_ranks == 6  # 3 trainer nodes x 2 ranks


def test_on_gpus_every_process_sees_cuda_and_the_broadcast_group_holds_every_server():
    flags = ["--cluster.gpus-per-node", "2", "--weight-transfer.mode", "broadcast", "--weight-transfer.port", "29501",
             "--weight-transfer.host", "trainer-0"]  # fmt: skip
    configs = process_configs(cluster(*flags))
    servers = [configs[f"inference_{i}"] for i in range(4)]
    assert {s.device for s in servers} == {"cuda"} and configs["trainer"].device == "cuda"
    assert [s.weight_transfer.rank for s in servers] == [1, 2, 3, 4]
    assert {s.weight_transfer.receivers for s in servers} == {4}
    assert {s.weight_transfer.host for s in [*servers, configs["trainer"]]} == {"trainer-0"}
    assert configs["trainer"].weight_transfer.receivers == 4


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--weight-transfer.mode", "broadcast"], "set weight_transfer.port"),
        (["--orchestrator.inference-urls", '["http://a:8000"]'], "holds 1 URL"),
    ],
)
def test_a_layout_a_cluster_cannot_run_is_one_clear_error(flags, message):
    with pytest.raises(AsyncRLError, match=message):
        process_configs(cluster(*flags))


def test_a_node_runs_no_more_servers_or_ranks_than_it_has_gpus():
    with pytest.raises(ConfigError, match="cluster.trainer_ranks_per_node = 2 but a node has 1 GPUs"):
        cluster("--cluster.gpus-per-node", "1")


# ---- the run folder ----


def small_run(tmp_path, *flags: str) -> RLConfig:
    return load(RLConfig, ["--output-dir", str(tmp_path / "run"), *flags])[0]


def test_prepare_writes_every_config_then_the_token_every_node_checks(tmp_path, monkeypatch):
    monkeypatch.setenv(run_folder.TOKEN_ENV, "job-token")
    cfg = small_run(tmp_path)
    assert prepare(cfg) is None
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "configs").iterdir()) == [
        "inference.toml", "orchestrator.toml", "rl.toml", "trainer.toml"
    ]  # fmt: skip
    assert run_folder.read_token(run) == "job-token"
    run_folder.check(run, "job-token", timeout=1)


def test_a_node_that_sees_another_folder_says_so(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(AsyncRLError, match=r"sees no RUN_TOKEN in the run folder .*elsewhere.*every node mounts"):
        run_folder.check(tmp_path / "elsewhere", "job-token", timeout=0.5)
    run_folder.mark(tmp_path / "elsewhere", "an-earlier-job")
    with pytest.raises(AsyncRLError, match="sees another job's RUN_TOKEN"):
        run_folder.check(tmp_path / "elsewhere", "job-token", timeout=0.5)


def test_prepare_keeps_an_earlier_run_unless_told_to_clean_it(tmp_path, monkeypatch):
    monkeypatch.setenv(run_folder.TOKEN_ENV, "job-token")
    cfg = small_run(tmp_path)
    prepare(cfg)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "source": "trainer"}\n')
    with pytest.raises(AsyncRLError, match="already holds a run"):
        prepare(cfg)
    prepare(cfg, clean=True)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_job_requeued_before_its_first_checkpoint_starts_over(tmp_path, monkeypatch):
    monkeypatch.setenv(run_folder.TOKEN_ENV, "job-token")
    cfg = small_run(tmp_path)
    prepare(cfg)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "source": "trainer"}\n')
    assert prepare(cfg, requeued=True) is None
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert "resume" not in tomllib.loads((tmp_path / "run" / "configs" / "trainer.toml").read_text())


def test_prepare_needs_the_jobs_token(tmp_path, monkeypatch):
    monkeypatch.delenv(run_folder.TOKEN_ENV, raising=False)
    with pytest.raises(AsyncRLError, match="ASYNCRL_RUN_TOKEN is not set"):
        prepare(small_run(tmp_path))


# ---- Slurm ----

SLURM = ["--cluster.trainer-nodes", "2", "--cluster.inference-nodes", "3", "--cluster.replicas-per-node", "4",
         "--cluster.trainer-ranks-per-node", "8", "--cluster.gpus-per-node", "8", "--cluster.slurm.partition", "gpu",
         "--cluster.slurm.sbatch", '["--qos=high"]', "--cluster.name", "my run"]  # fmt: skip


def test_the_sbatch_script_asks_for_every_node_and_starts_each_role_with_srun(tmp_path):
    cfg, raw, _ = load_as_given(["--output-dir", str(tmp_path / "run"), *SLURM], frozenset())
    script = slurm.render(cfg, raw)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    options = re.findall(r"^#SBATCH (.*)$", script, re.M)
    assert {"--job-name=my-run", "--nodes=5", "--gpus-per-node=8", "--requeue", "--partition=gpu", "--qos=high"} <= set(
        options
    )
    sruns = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(sruns) == 4  # the folder check on every node, inference, trainer, orchestrator
    assert "--nodes=5 --ntasks-per-node=1" in sruns[0]
    assert "--nodes=3 --ntasks-per-node=4" in sruns[1] and "--gpus-per-task=1" in script
    assert "--kill-on-bad-exit=1" in script  # a server that fails ends its step, and so the job
    assert "--nnodes=2 --nproc-per-node=8" in script and '--node-rank="$SLURM_NODEID"' in script
    assert "--overlap" in sruns[3]
    assert "configs/inference_$SLURM_PROCID.toml" in script
    assert f"RUN={tmp_path / 'run'}" in script


def test_the_script_holds_the_config_as_given(tmp_path):
    cfg, raw, _ = load_as_given(["--output-dir", str(tmp_path / "run"), "--trainer.optim.lr", "0.01"], frozenset())
    script = slurm.render(cfg, raw, clean=True)
    copy = script.split("<<'ASYNCRL_CONFIG'\n", 1)[1].split("ASYNCRL_CONFIG\n", 1)[0]
    assert tomllib.loads(copy) == raw
    assert 'PREPARE="--clean"' in script


@pytest.mark.skipif(shutil.which("sbatch") is not None, reason="a Slurm client is installed here")
def test_submit_without_slurm_says_where_to_run_it():
    with pytest.raises(AsyncRLError, match="sbatch not found"):
        slurm.submit("#!/bin/bash\n")


# ---- Kubernetes ----

K8S = ["--cluster.trainer-nodes", "2", "--cluster.inference-nodes", "2", "--cluster.replicas-per-node", "2",
       "--cluster.trainer-ranks-per-node", "4", "--cluster.gpus-per-node", "4", "--cluster.k8s.image",
       "registry.example/asyncrl:1", "--weight-transfer.mode", "broadcast", "--weight-transfer.port", "29501",
       "--output-dir", "runs/demo"]  # fmt: skip


def manifests(*flags: str) -> dict[str, dict]:
    cfg, raw, _ = load_as_given([*K8S, *flags], frozenset())
    documents = list(yaml.safe_load_all(k8s.render(cfg, raw)))
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in documents}


def test_the_manifests_validate_against_the_kubernetes_api_schemas():
    for document in manifests().values():
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(document, version, strict=True)  # raises with the path of a bad field


def test_the_manifests_hold_every_part_of_the_run():
    objects = manifests()
    assert sorted(objects) == [
        "ConfigMap/demo-config", "Job/demo-orchestrator", "Job/demo-trainer", "PersistentVolumeClaim/demo-run",
        "Secret/demo-secrets", "Service/demo-inference", "Service/demo-trainer", "StatefulSet/demo-inference",
    ]  # fmt: skip
    assert objects["PersistentVolumeClaim/demo-run"]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert sorted(objects["Secret/demo-secrets"]["stringData"]) == ["admin-token", "api-key"]
    assert objects["Service/demo-trainer"]["spec"]["clusterIP"] == "None"


def test_the_trainer_is_an_indexed_job_whose_pods_meet_at_pod_0():
    trainer = manifests()["Job/demo-trainer"]["spec"]
    assert trainer["completionMode"] == "Indexed" and trainer["completions"] == trainer["parallelism"] == 2
    pod = trainer["template"]["spec"]
    assert pod["subdomain"] == "demo-trainer"
    [container] = pod["containers"]
    command = container["command"][-1]
    assert "--nnodes=2 --nproc-per-node=4" in command and '--node-rank="$JOB_COMPLETION_INDEX"' in command
    assert "--rdzv-endpoint=demo-trainer-0.demo-trainer:29500" in command
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 4}


def test_every_server_has_a_gpu_and_a_name_the_orchestrator_reaches_it_by():
    objects = manifests()
    inference = objects["StatefulSet/demo-inference"]["spec"]
    assert inference["replicas"] == 2 and inference["serviceName"] == "demo-inference"
    containers = inference["template"]["spec"]["containers"]
    assert [c["resources"]["limits"] for c in containers] == [{"nvidia.com/gpu": 1}] * 2
    assert [c["ports"][0]["containerPort"] for c in containers] == [8000, 8001]
    configs = objects["ConfigMap/demo-config"]["data"]
    orchestrator = tomllib.loads(configs["orchestrator.toml"])
    assert orchestrator["inference_urls"] == [
        "http://demo-inference-0.demo-inference:8000", "http://demo-inference-0.demo-inference:8001",
        "http://demo-inference-1.demo-inference:8000", "http://demo-inference-1.demo-inference:8001",
    ]  # fmt: skip
    assert orchestrator["weight_transfer"]["host"] == "demo-trainer-0.demo-trainer"
    assert tomllib.loads(configs["inference_3.toml"])["weight_transfer"]["rank"] == 4


def test_every_pod_but_the_preparing_one_first_checks_the_run_folder():
    objects = manifests()
    for name in ("StatefulSet/demo-inference", "Job/demo-trainer"):
        [check] = objects[name]["spec"]["template"]["spec"]["initContainers"]
        assert check["command"][:4] == ["asyncrl", "run-folder", "check", "runs/demo"]
    [prepare] = objects["Job/demo-orchestrator"]["spec"]["template"]["spec"]["initContainers"]
    assert prepare["command"][:3] == ["asyncrl", "run-folder", "prepare"]


def test_cpu_nodes_request_no_gpus():
    objects = manifests("--cluster.gpus-per-node", "0")
    for container in objects["StatefulSet/demo-inference"]["spec"]["template"]["spec"]["containers"]:
        assert "resources" not in container


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cluster.k8s.image", ""], "cluster.k8s.image is not set"),
        (["--output-dir", "/elsewhere/run"], "not on the shared volume mounted at /shared"),
    ],
)
def test_manifests_that_cannot_run_are_one_clear_error(flags, message):
    with pytest.raises(AsyncRLError, match=message):
        manifests(*flags)


# ---- the examples ----

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    "layers",
    [["slurm/cpu.toml"], ["reverse_text/rl.toml", "slurm/gpu.toml"]],
)
def test_the_slurm_examples_render_to_valid_bash(layers):
    cfg, raw, _ = load_as_given([arg for layer in layers for arg in ("@", str(EXAMPLES / layer))], frozenset())
    assert subprocess.run(["bash", "-n"], input=slurm.render(cfg, raw), text=True).returncode == 0


def test_the_kubernetes_example_renders_valid_manifests():
    argv = ["@", str(EXAMPLES / "arithmetic" / "rl.toml"), "@", str(EXAMPLES / "k8s" / "gpu.toml")]
    cfg, raw, _ = load_as_given([*argv, "--model.name", "Qwen/Qwen3-0.6B"], frozenset())
    for document in yaml.safe_load_all(k8s.render(cfg, raw)):
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)
