"""The trainer as real processes: `asyncrl trainer` under torchrun on 1 and 2 ranks (and 2 nodes of one rank), and
`asyncrl sft`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.metrics import read_jsonl
from asyncrl.models.offline import init_model
from asyncrl.orchestrator.packing import padding_micro_batch
from asyncrl.transport.rollouts import MicroBatch, rank_file, step_dir, write_batch
from asyncrl.transport.weights import MARKER, load_state_dict, weights_dir

pytestmark = pytest.mark.integration

STEPS = 3
ROWS = 3  # micro-batches of the global batch; with 2 ranks, rank 1 gets one row and a padding row
VOCAB = 259


def synthetic_row(generator: torch.Generator, seq_len: int = 48) -> MicroBatch:
    """A packed row of three samples: a prompt (not trained on) and a sampled completion each."""
    lengths = [16, 12, seq_len - 28]
    input_ids = torch.randint(0, VOCAB, (seq_len,), generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    loss_mask = torch.cat([torch.arange(n) >= n // 2 for n in lengths])
    advantages = torch.cat([torch.full((n,), float(torch.randn(1, generator=generator))) for n in lengths])
    # Inference probabilities near the tiny model's (~1/VOCAB), and a few far above it, so that the
    # low side of the trust region masks some tokens.
    inference_logprobs = torch.log(torch.full((seq_len,), 1.0 / VOCAB)) + 0.1 * torch.randn(
        seq_len, generator=generator
    )
    inference_logprobs[::7] = -0.7
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        loss_mask=loss_mask,
        advantages=advantages * loss_mask,
        inference_logprobs=inference_logprobs * loss_mask,
        temperature=torch.full((seq_len,), 0.8),
        sample_lengths=torch.tensor(lengths),
    )


def write_rollouts(output_dir: Path, world_size: int) -> None:
    for step in range(1, STEPS + 1):
        generator = torch.Generator().manual_seed(step)
        rows = [synthetic_row(generator) for _ in range(ROWS)]
        shares = [rows] if world_size == 1 else [rows[:2], [rows[2], padding_micro_batch(0)]]
        for rank, share in enumerate(shares):
            write_batch(rank_file(output_dir, step, rank), share)


def run_asyncrl(args: list[str], nproc: int | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, *launcher, "-m", "asyncrl", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert result.returncode == 0, f"asyncrl {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny"
    init_model(path, "tiny")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model) -> dict[int | str, Path]:
    """The same three global batches trained on 1 rank, on 2 ranks (its steps 2 and 3 traced by torch.profiler,
    into `profile/`), and on 2 "nodes" of one rank each (two torchrun agents meeting at a c10d rendezvous on
    loopback, as on two machines)."""
    args = ["trainer", "--model.name", str(tiny_model), "--max-steps", str(STEPS), "--optim.lr", "1e-3",
            "--num-threads", "1", "--device", "cpu", "--keep-weights", "2", "--wait-timeout", "60"]  # fmt: skip
    runs: dict[int | str, Path] = {}
    for world_size in (1, 2):
        output_dir = tmp_path_factory.mktemp(f"world{world_size}")
        write_rollouts(output_dir, world_size)
        profile = ["--profile.dir", str(output_dir / "profile"), "--profile.wait", "0", "--profile.warmup", "1",
                   "--profile.active", "2"] if world_size == 2 else []  # fmt: skip
        run_asyncrl([*args, "--output-dir", str(output_dir), *profile], nproc=world_size)
        runs[world_size] = output_dir
    runs["two_nodes"] = output_dir = tmp_path_factory.mktemp("two_nodes")
    write_rollouts(output_dir, 2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes",
             "-m", "asyncrl", *args, "--output-dir", str(output_dir)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for _ in range(2)
    ]
    # Past torchrun's exit barrier (it waits up to 300 s for the other agent): once, in a full-suite run, the
    # agents had not both exited 240 s in, after rank 0 had trained its steps; alone they take ~20 s.
    deadline = time.monotonic() + 420
    try:
        for process in agents:
            output = process.communicate(timeout=max(deadline - time.monotonic(), 1))[0]
            assert process.returncode == 0, f"torchrun agent failed:\n{output}"
    finally:
        for process in agents:
            process.kill()
    return runs


def trainer_metrics(output_dir: Path) -> list[dict]:
    return [m for m in read_jsonl(output_dir / "metrics.jsonl") if m["source"] == "trainer"]


def test_one_and_two_ranks_log_the_same_losses(trained):
    one, two = trainer_metrics(trained[1]), trainer_metrics(trained[2])
    assert [m["step"] for m in one] == [m["step"] for m in two] == [1, 2, 3]
    for a, b in zip(one, two):
        for name in ("loss", "entropy", "mismatch_kl", "masked/low", "masked/high", "grad_norm"):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), (a["step"], name)
    assert one[0]["masked/low"] > 0  # the synthetic batch does exercise the trust region
    assert one[0]["lr"] == pytest.approx(1e-3)


def test_one_and_two_ranks_publish_the_same_weights(trained):
    one = load_state_dict(weights_dir(trained[1], STEPS))
    two = load_state_dict(weights_dir(trained[2], STEPS))
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(one[name], two[name], rtol=0, atol=1e-4, msg=name)


def test_two_nodes_of_one_rank_train_as_one_node_of_two_ranks(trained):
    two_ranks, two_nodes = trainer_metrics(trained[2]), trainer_metrics(trained["two_nodes"])
    assert [m["step"] for m in two_nodes] == [1, 2, 3]
    for a, b in zip(two_ranks, two_nodes):
        for name in ("loss", "entropy", "mismatch_kl", "masked/low", "masked/high", "grad_norm"):
            assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-6), (a["step"], name)
    expected = load_state_dict(weights_dir(trained[2], STEPS))
    got = load_state_dict(weights_dir(trained["two_nodes"], STEPS))
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-4, msg=name)


def test_weights_change_and_load_with_from_pretrained(trained, tiny_model):
    published = weights_dir(trained[2], STEPS)
    assert (published / MARKER).exists()
    model = AutoModelForCausalLM.from_pretrained(published)
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    changed = [not torch.equal(p, q) for p, q in zip(model.parameters(), base.parameters())]
    assert all(changed)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_trainer_keeps_newest_weights_and_deletes_consumed_rollouts(trained):
    for output_dir in trained.values():
        assert sorted(p.name for p in (output_dir / "weights").iterdir()) == ["step_2", "step_3"]
        assert not any(step_dir(output_dir, step).exists() for step in range(1, STEPS + 1))


def test_trainer_logs_timestamps_of_compute(trained):
    for m in trainer_metrics(trained[2]):
        assert m["timestamp/train_start"] <= m["timestamp/train_end"]
        assert m["time/wait_for_batch"] >= 0 and m["time/step"] > 0 and m["perf/tokens_per_s"] > 0


def test_the_step_time_breaks_down_into_its_parts(trained):
    """Waiting, forward and backward, optimizer, publishing: each measured, together the step within 2%; the
    publish is gathering the weights and handing them to the write, together within 2% (or 1 ms) of it."""
    parts = ("time/wait_for_batch", "time/forward_backward", "time/optimizer", "time/publish")
    for m in trainer_metrics(trained[2]):
        assert all(m[part] >= 0 for part in parts) and m["time/forward_backward"] > 0
        assert sum(m[part] for part in parts) == pytest.approx(m["time/step"], rel=0.02)
        assert m["timestamp/train_end"] - m["timestamp/train_start"] == pytest.approx(
            m["time/step"] - m["time/wait_for_batch"], rel=0.02
        )
        assert m["time/publish_gather"] > 0 and m["time/publish_write"] > 0
        assert m["batch/micro_batches"] >= 1 and 0 < m["batch/fill"] <= 1
        assert m["time/publish_gather"] + m["time/publish_write"] == pytest.approx(
            m["time/publish"], rel=0.02, abs=1e-3
        )


def test_a_profiled_trainer_writes_a_chrome_trace_of_its_traced_steps_from_each_rank(trained):
    for rank in (0, 1):
        trace = json.loads((trained[2] / "profile" / f"trainer_rank_{rank}.json").read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        assert {"ProfilerStep#1", "ProfilerStep#2"} <= names, rank  # the two active steps, after one of warm-up
        assert "ProfilerStep#0" not in names, rank
        assert {"aten::mm", "Optimizer.step#AdamW.step"} <= names, rank  # the step's matrix products, its AdamW


def test_trainer_names_the_missing_rollout_file(tmp_path, tiny_model):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl",
            "trainer",
            "--model.name",
            str(tiny_model),
            "--output-dir",
            str(tmp_path),
            "--max-steps",
            "1",
            "--wait-timeout",
            "0.5",
            "--num-threads",
            "1",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert str(rank_file(tmp_path, 1, 0)) in result.stderr


def test_sft_lowers_the_loss_and_writes_a_loadable_model(tmp_path, tiny_model):
    output_dir = tmp_path / "sft"
    result = run_asyncrl(
        [
            "sft",
            "--model.name",
            str(tiny_model),
            "--output-dir",
            str(output_dir),
            "--max-steps",
            "30",
            "--data.batch-size",
            "16",
            "--seq-len",
            "512",
            "--optim.lr",
            "3e-3",
            "--optim.warmup-steps",
            "3",
            "--log-interval",
            "5",
            "--num-threads",
            "1",
            "--device",
            "cpu",
        ]
    )
    lines = [m for m in read_jsonl(output_dir / "metrics.jsonl") if m["source"] == "sft"]
    losses = [m["loss"] for m in lines]
    assert len(losses) == 6
    assert losses[-1] < 0.8 * losses[0]
    answers = [m["tokens/answer"] for m in lines]
    assert 0 < answers[0] < answers[-1] < lines[-1]["tokens/total"]  # counted as they are trained on
    assert f"sft: trained 30 steps, {answers[-1]:,} answer tokens" in result.stdout
    model = AutoModelForCausalLM.from_pretrained(output_dir / "final")
    assert model.config.vocab_size == VOCAB
    assert (output_dir / "final" / "tokenizer.json").exists()


def bench_args(tiny_model: Path, *extra: str) -> list[str]:
    return ["trainer", "--bench", "--model.name", str(tiny_model), "--num-threads", "1", "--device", "cpu", *extra]


def test_bench_times_the_fsdp_step_on_two_ranks_and_prints_its_figures(tiny_model, tmp_path):
    profile = tmp_path / "profile"
    result = run_asyncrl(
        bench_args(tiny_model, "--seq-len", "256", "--bench.documents", "4", "--bench.steps", "2")
        + ["--bench.profile", str(profile)],
        nproc=2,
    )
    assert "tokens/s | MFU n/a (unknown peak)" in result.stdout
    figures = json.loads(result.stdout.split("bench-json: ")[1].splitlines()[0])
    assert figures["ranks"] == 2 and figures["steps"] == 2 and figures["attention"] == "document"
    assert figures["row_attention_kernel"] == "sdpa"  # per sample on a CPU
    assert figures["tokens_per_s"] == pytest.approx(2 * 256 / figures["step_time_s"])
    assert figures["peak_memory_gib"] > 0 and figures["mfu"] is None  # no known peak FLOP/s on a CPU
    # --bench.profile: a Chrome trace per rank, and rank 0's table of the costliest ops
    for rank in (0, 1):
        assert json.loads((profile / f"trace_rank{rank}.json").read_text())["traceEvents"]
    assert "aten::mm" in (profile / "kernels.txt").read_text() and "Self CPU time total" in result.stdout


def test_bench_names_a_row_it_cannot_split_into_equal_documents(tiny_model):
    result = subprocess.run(
        [sys.executable, "-m", "asyncrl", *bench_args(tiny_model, "--seq-len", "100", "--bench.documents", "3")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "seq_len 100 is not a multiple of bench.documents 3" in result.stderr


def test_sft_from_a_jsonl_file_trains_its_epochs_then_stops_and_saves_intermediate_models(tmp_path, tiny_model):
    data = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": w[::-1]}]} for w in WORDS]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output_dir = tmp_path / "sft"
    result = run_asyncrl(
        ["sft", "--model.name", str(tiny_model), "--output-dir", str(output_dir), "--data.path", str(data),
         "--data.epochs", "2", "--data.batch-size", "8", "--eval.size", "4", "--max-steps", "100",
         "--save-interval", "2", "--log-interval", "1", "--seq-len", "256", "--num-threads", "1", "--device", "cpu"]
    )  # fmt: skip
    # 20 rows, 4 held out: 2 epochs of 16 conversations in batches of 8
    assert "the data lasts 4 of max_steps 100" in result.stdout
    steps = [m["step"] for m in read_jsonl(output_dir / "metrics.jsonl") if "loss" in m]
    assert steps == [1, 2, 3, 4]
    assert "eval/loss" in read_jsonl(output_dir / "metrics.jsonl")[-1]
    assert sorted(p.name for p in (output_dir / "weights").iterdir()) == ["step_2"]
    for folder in (output_dir / "weights" / "step_2", output_dir / "final"):
        assert AutoModelForCausalLM.from_pretrained(folder).config.vocab_size == VOCAB


WORDS = ["apple", "river", "stone", "cloud", "light", "green", "music", "table", "chair", "plant",
         "ocean", "tiger", "bread", "smile", "house", "paper", "train", "horse", "glass", "sugar"]  # fmt: skip
