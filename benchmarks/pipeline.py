"""The whole pipeline end to end: `asyncrl rl` on a long-tail workload, synchronous against asynchronous,
one inference server against two.

    python benchmarks/pipeline.py --preset tiny                                   # CPU, ~0.1M parameters
    python benchmarks/pipeline.py --preset qwen3-0.6b --device cuda --median-tokens 256 --max-tokens 2048

Every case is a real `asyncrl rl` run (inference servers, orchestrator, torchrun trainer, weights by each
`--modes` transfer mode, by default files in the run folder) on the workload of `pipeline_env.py`: per-group
completion lengths drawn from a log-normal distribution, EOS ignored. Each case runs `--steps` trainer steps;
the first `--skip` are left out (start-up, compilation), and over the rest it reports, from metrics.jsonl:

    s/step           wall time per trainer step (last train end - train end of step `skip`) / steps
    trained tok/s    tokens the trainer trained on (packed rows, prompt included) per wall second
    trainer busy     share of that wall time the trainer spent training (not waiting for a batch)
    inference busy   share of that wall time the servers had requests in flight (mean over servers)
    vs sync          trained tok/s against the max_async_level = 0 run with the same servers and weights
    train / generate the parts alone, per step: the trainer's forward, backward and optimizer seconds, and
                     the seconds the servers had requests in flight (busiest server), both from the
                     max_async_level = 0 run, where the two take turns and never share the hardware
    vs bound         s/step over the sequential bound, train + generate of that run (1.00x: every second
                     of the step is one part working alone; below 1: the parts overlap)
    predicted        the s/step `asyncrl plan` gives for the case's layout and mode from parts calibrated on the
                     case itself (`asyncrl plan --calibrate`, docs/clusters.md), and its error against s/step

All cases run one after the other in this one invocation, so they are compared on the same machine.

`--profile DIR` also writes a torch.profiler Chrome trace of each case's steps `skip` + 2 and `skip` + 3
(the step after `skip` warms the profiler up): DIR/<mode>_level<L>_replicas<R>/trainer_rank_<r>.json from
every trainer rank, orchestrator.json, which records every Python call of the orchestrator, and
inference_<port>.json from every server, over the two policy versions after its first `skip` + 1 weight
updates (the `trainer.profile`, `orchestrator.profile` and `inference.profile` options, docs/trainer.md).
Tracing slows those steps, so take the figures from a run without it. `--keep DIR` copies each case's
metrics.jsonl, configs/ and logs/ to DIR/<mode>_level<L>_replicas<R>/, enough for `asyncrl plan --calibrate`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shapes import build_model  # benchmarks/, the script's own folder

from asyncrl.errors import AsyncRLError
from asyncrl.plan.calibrate import calibrate, layout
from asyncrl.plan.model import predict

HERE = Path(__file__).resolve().parent
PROFILED_STEPS = 2  # with --profile: traced steps of each case, after `skip` and one to warm the profiler up


def run_case(args, model: Path, root: Path, level: int, replicas: int, mode: str) -> dict:
    output_dir = root / f"{mode}_level{level}_replicas{replicas}"
    shutil.rmtree(output_dir, ignore_errors=True)
    env_args = (
        f"{{median_tokens = {args.median_tokens}, sigma = {args.sigma}, max_tokens = {args.max_tokens}, "
        f"prompt_tokens = {args.prompt_tokens}}}"
    )
    argv = [
        sys.executable, "-m", "asyncrl", "rl", "--model.name", str(model), "--output-dir", str(output_dir),
        "--max-steps", str(args.steps), "--seq-len", str(args.prompt_tokens + args.max_tokens),
        "--model.dtype", args.dtype, "--inference.port", "0",
        "--orchestrator.environments.long_tail.name", "pipeline_env:LongTail",
        "--orchestrator.environments.long_tail.args", env_args,
        "--orchestrator.batch-size", str(args.batch_size), "--orchestrator.group-size", str(args.group_size),
        "--orchestrator.max-async-level", str(level), "--orchestrator.max-inflight", str(args.max_inflight),
        "--orchestrator.sampling.max-tokens", str(args.max_tokens), "--orchestrator.sampling.ignore-eos",
        "--orchestrator.samples-per-step", "0", "--trainer.optim.lr", "1e-6",
        "--deployment.inference-replicas", str(replicas), "--weight-transfer.mode", mode, *args.extra,
    ]  # fmt: skip
    if args.device == "cpu":
        argv += ["--deployment.inference-device", "cpu", "--deployment.trainer-device", "cpu"]
    if args.profile is not None:
        for process in ("trainer", "orchestrator", "inference"):
            argv += [f"--{process}.profile.dir", str(args.profile.resolve() / output_dir.name),
                     f"--{process}.profile.wait", str(args.skip), f"--{process}.profile.warmup", "1",
                     f"--{process}.profile.active", str(PROFILED_STEPS)]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    }
    start = time.time()
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
    if result.returncode != 0:
        raise SystemExit(
            f"case {mode}, level {level}, {replicas} server(s) failed:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    if args.keep is not None:
        kept = args.keep / output_dir.name
        shutil.rmtree(kept, ignore_errors=True)
        kept.mkdir(parents=True)
        shutil.copy2(output_dir / "metrics.jsonl", kept)
        for folder in ("configs", "logs"):
            shutil.copytree(output_dir / folder, kept / folder)
    row = summarize(output_dir, args.skip, time.time() - start) | {"level": level, "replicas": replicas, "mode": mode}
    return row | {"predicted_s": predicted_step(output_dir, args.skip, mode)}


def predicted_step(output_dir: Path, skip: int, mode: str) -> float | None:
    """`asyncrl plan`'s s/step for the run's own layout and mode, from parts calibrated on the run."""
    try:
        parts = calibrate(output_dir, skip)
    except AsyncRLError as error:
        print(f"no prediction for {output_dir.name}: {error}", file=sys.stderr)
        return None
    return predict(parts, *layout(output_dir), mode).step_s


def summarize(output_dir: Path, skip: int, seconds: float) -> dict:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trainer = {r["step"]: r for r in records if r["source"] == "trainer"}
    orchestrator = {r["step"]: r for r in records if r["source"] == "orchestrator" and "batch/rollouts" in r}
    steps = sorted(trainer)[skip:]
    begin = (
        trainer[steps[0] - 1]["timestamp/train_end"]
        if steps[0] - 1 in trainer
        else trainer[steps[0]]["timestamp/train_start"]
    )
    wall = trainer[steps[-1]]["timestamp/train_end"] - begin
    train_seconds = [trainer[n]["timestamp/train_end"] - trainer[n]["timestamp/train_start"] for n in steps]
    tokens = sum(trainer[n]["perf/tokens_per_s"] * t for n, t in zip(steps, train_seconds))
    # Inference: the servers' idle share per batch, weighted by the batch's time.
    batches = [orchestrator[n] for n in steps if n in orchestrator]
    idle = sum(b["perf/inference_idle"] * b["time/step"] for b in batches) / max(
        sum(b["time/step"] for b in batches), 1e-9
    )
    # The parts, per step: training (forward, backward, optimizer) and generating (the busiest server's
    # seconds with requests in flight).
    servers = len([k for k in batches[0] if k.startswith("perf/server/") and k.endswith("/idle")])
    generate = [
        max((1 - b[f"perf/server/{i}/idle"]) for i in range(servers)) * b["time/step"] if servers else 0.0
        for b in batches
    ]
    return {
        "s_per_step": wall / len(steps),
        "train_s": statistics.fmean(trainer[n]["time/forward_backward"] + trainer[n]["time/optimizer"] for n in steps),
        "generate_s": statistics.fmean(generate),
        "tokens_per_s": tokens / wall,
        "trainer_busy": sum(train_seconds) / wall,
        "inference_busy": 1 - idle,
        "generated_tokens_per_s": statistics.fmean(b["perf/generate_tokens_per_s"] for b in batches),
        "publish_s": statistics.fmean(trainer[n]["time/publish"] for n in steps),
        "micro_batches": statistics.fmean(trainer[n]["batch/micro_batches"] for n in steps),
        "fill": statistics.fmean(trainer[n]["batch/fill"] for n in steps),
        "dropped": sum(b["off_policy/dropped"] for b in batches),
        "cancelled": sum(b["groups/cancelled"] for b in batches),
        "run_seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="an `asyncrl model init` preset, or qwen3-0.6b")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (asyncrl rl places the processes)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2], help="max_async_level values")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="inference servers")
    parser.add_argument(
        "--modes", nargs="+", default=["filesystem"], help="weight_transfer.mode values (colocated: one device)"
    )
    parser.add_argument("--steps", type=int, default=12, help="trainer steps per case")
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the figures")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-inflight", type=int, default=64)
    parser.add_argument("--median-tokens", type=int, default=32, help="median completion length")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of completion lengths")
    parser.add_argument("--max-tokens", type=int, default=256, help="longest completion")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per case")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    parser.add_argument(
        "--profile", type=Path, default=None, help="also write torch.profiler traces of each case's trainer, "
        "orchestrator and servers here, one folder per case (it slows the traced steps)",
    )  # fmt: skip
    parser.add_argument(
        "--keep", type=Path, default=None, help="copy each case's metrics.jsonl, configs/ and logs/ here"
    )
    parser.add_argument("extra", nargs="*", help="more `asyncrl rl` flags for every case, after --")
    args = parser.parse_args()
    if args.profile is not None and args.skip + 1 + PROFILED_STEPS > args.steps:
        parser.error(f"--profile traces steps {args.skip + 2}-{args.skip + 1 + PROFILED_STEPS}: raise --steps")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")

    root = Path(tempfile.mkdtemp(prefix="pipeline_"))
    model = build_model(args.preset, root / "model", "cuda" if args.device.startswith("cuda") else "cpu")
    rows = []
    for mode in args.modes:
        for replicas in args.replicas:
            for level in args.levels:
                row = run_case(args, model, root, level, replicas, mode)
                rows.append(row)
                print(json.dumps(row), flush=True)

    print(
        f"\npipeline: {args.preset} ({args.dtype}) on {args.device}; batch {args.batch_size} = "
        f"{args.batch_size // args.group_size} groups x {args.group_size}; completion lengths log-normal "
        f"(median {args.median_tokens}, sigma {args.sigma}, at most {args.max_tokens}), EOS ignored; "
        f"steps {args.skip + 1}-{args.steps} of {args.steps}"
    )
    columns = [("weights", 12), ("servers", 8), ("level", 7), ("s/step", 9), ("trained tok/s", 15),
               ("trainer busy", 14), ("inference busy", 16), ("vs sync", 9), ("train", 7), ("generate", 10),
               ("vs bound", 10), ("predicted", 11), ("error", 8), ("dropped", 9),
               ("cancelled", 11)]  # fmt: skip
    header = "".join(f"{name:>{width}}" for name, width in columns)
    print(header)
    for row in rows:
        sync = next(
            (r for r in rows if (r["mode"], r["replicas"], r["level"]) == (row["mode"], row["replicas"], 0)), None
        )
        ratio = f"{row['tokens_per_s'] / sync['tokens_per_s']:.2f}x" if sync else "-"
        parts = (
            f"{sync['train_s']:>7.2f}{sync['generate_s']:>10.2f}"
            f"{row['s_per_step'] / (sync['train_s'] + sync['generate_s']):>9.2f}x"
            if sync
            else f"{'-':>7}{'-':>10}{'-':>10}"
        )
        predicted = (
            f"{row['predicted_s']:>11.2f}{row['predicted_s'] / row['s_per_step'] - 1:>+8.0%}"
            if row["predicted_s"] is not None
            else f"{'-':>11}{'-':>8}"
        )
        print(
            f"{row['mode']:>12}{row['replicas']:>8}{row['level']:>7}{row['s_per_step']:>9.2f}{row['tokens_per_s']:>15.0f}"
            f"{row['trainer_busy']:>14.0%}{row['inference_busy']:>16.0%}{ratio:>9}{parts}{predicted}"
            f"{row['dropped']:>9}{row['cancelled']:>11}"
        )
    by_level = {}
    for row in rows:
        by_level.setdefault((row["mode"], row["level"]), {})[row["replicas"]] = row
    for (mode, level), cases in sorted(by_level.items()):
        if 1 in cases and 2 in cases:
            gain = cases[2]["generated_tokens_per_s"] / cases[1]["generated_tokens_per_s"]
            print(f"{mode}, level {level}: two servers generate {gain:.2f}x the tokens/s of one")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
