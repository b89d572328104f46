"""The `asyncrl` command: one entry point, one subcommand per process or job."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from asyncrl.cpu_threads import passive_openmp_wait
from asyncrl.errors import AsyncRLError
from asyncrl.processes import die_with_torchrun_agent, under_torchrun

USAGE = """usage: asyncrl COMMAND [@ config.toml ...] [--section.key value ...]

commands:
  rl            run inference, orchestrator and trainer together from one config
  inference     serve the policy over HTTP (OpenAI-compatible + token routes)
  orchestrator  generate rollouts, score them, compute advantages, write batches
  trainer       train on rollout batches (run under torchrun for several ranks)
                '--bench': time train steps on random tokens (tokens/s, MFU, memory)
  sft           supervised fine-tuning on chat data
  eval          avg@n / pass@k of environments against a model folder or a served model (docs/evals.md)
  env-server    run environments' respond() and rewards in worker processes (docs/environments.md)
  model init    build a small model and byte-level tokenizer offline
  dashboard     a local web page of runs: live charts, configs, logs, rollouts ('asyncrl dashboard outputs')
  plot          PNG plots of runs' standard curves ('asyncrl plot RUN [RUN ...] --out DIR')
  slurm         render the run as one sbatch script for several nodes ('--submit' submits it; docs/clusters.md)
  k8s           render the run as Kubernetes manifests (docs/clusters.md)
  plan          predict s/step and idle time of each split of N GPUs from measured parts, or calibrate
                them on a finished run ('asyncrl plan --parts parts.json --gpus 8'; docs/clusters.md)

Config files are layered left to right ('@ a.toml @ b.toml'), then dotted flags override them
('--trainer.optim.lr 1e-5'). 'asyncrl rl --dry-run' prints the resolved configs and starts nothing;
'asyncrl rl --clean' replaces an earlier run in the same output_dir; '--resume' (rl, sft) continues it
from its newest complete checkpoint, '--resume.step N' from step N (docs/checkpoints.md). Every key, with
its type, default and meaning: 'asyncrl COMMAND --help', or docs/config.md.
Example: asyncrl rl @ examples/reverse_text/rl.toml
"""


def _model_init(argv: list[str]) -> None:
    from asyncrl.models.offline import ARCHITECTURES, PRESETS, init_model
    from asyncrl.progress import timed

    parser = argparse.ArgumentParser(
        prog="asyncrl model init",
        description="Build a small model (Qwen3, Llama, or the mixture-of-experts Qwen3-MoE and GLM-4.5 with 8 "
        "experts, top 2) and a byte-level ChatML tokenizer, offline, in Hugging Face format.",
    )
    parser.add_argument("--output", type=Path, required=True, help="folder to write the model to")
    parser.add_argument("--preset", choices=list(PRESETS), default="small", help="model size (default: small)")
    parser.add_argument("--architecture", choices=list(ARCHITECTURES), default="qwen3", help="(default: qwen3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with timed(f"building a {args.preset} {args.architecture} model"):
        count = init_model(args.output, args.preset, args.seed, args.architecture)
    print(f"wrote {args.preset} {args.architecture} model ({count / 1e6:.2f}M parameters) to {args.output}")


def _dashboard(argv: list[str]) -> int:
    from asyncrl.dashboard.app import serve

    parser = argparse.ArgumentParser(
        prog="asyncrl dashboard",
        description="A local web page of runs: live charts of metrics.jsonl, resolved configs, log tails and "
        "a rollout viewer of samples.jsonl. Select several runs to compare them.",
    )
    parser.add_argument(
        "runs", nargs="*", type=Path, default=[Path("outputs")],
        help="run folders (output_dir), or folders holding runs (default: outputs)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8265, help="port to bind; 0 picks a free one (default: 8265)")
    args = parser.parse_args(argv)
    return serve(args.runs, args.host, args.port)


def _plot(argv: list[str]) -> int:
    from asyncrl.plot import plot_runs

    parser = argparse.ArgumentParser(
        prog="asyncrl plot",
        description="PNG plots of the standard curves of one or more runs (several runs share each plot).",
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (each with a metrics.jsonl)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write the PNGs to")
    args = parser.parse_args(argv)
    for path in plot_runs(args.runs, args.out):
        print(path)
    return 0


def _redirect_rank_output() -> None:
    """Under `asyncrl rl`, each trainer rank writes to logs/trainer/rank_R.log instead of torchrun's stream."""
    log_dir = os.environ.get("ASYNCRL_RANK_LOG_DIR")
    if not log_dir:
        return
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(
        Path(log_dir) / f"rank_{os.environ.get('RANK', '0')}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _writing(run: Callable[[], int | None], output_dir: Path, kind: str) -> int | None:
    """`run()`, a process writing a run folder of `asyncrl rl` or `asyncrl sft`: a write the system refuses
    (a full disk, a read-only folder) ends it with one line naming the path and the checkpoint to resume from."""
    from asyncrl import checkpoints
    from asyncrl.write_errors import describe, refused_write

    try:
        return run()
    except (KeyboardInterrupt, SystemExit, AsyncRLError):
        raise
    except BaseException as error:  # torch.distributed.checkpoint's errors are BaseExceptions
        refused = refused_write(error)
        if refused is None:
            raise
        parts = checkpoints.RL_PARTS if kind == "rl" else checkpoints.SFT_PARTS
        raise describe(refused, output_dir, parts, f"asyncrl {kind}") from None


def _run(command: str, argv: list[str]) -> int | None:
    from asyncrl import config as cfg

    if command == "rl":
        from asyncrl.launcher import run_rl

        config, flags = cfg.load(cfg.RLConfig, argv, frozenset({"--dry-run", "--clean"}))
        return _writing(
            lambda: run_rl(config, dry_run="--dry-run" in flags, clean="--clean" in flags), config.output_dir, "rl"
        )
    if command == "inference":
        from asyncrl.cpu_threads import usable_cores
        from asyncrl.inference.api.server import serve

        config = cfg.load(cfg.InferenceConfig, argv)[0]
        config.num_threads = config.num_threads or usable_cores()
        return serve(config)
    if command == "orchestrator":
        from asyncrl.orchestrator.loop import run_orchestrator

        config = cfg.load(cfg.OrchestratorConfig, argv)[0]
        return _writing(lambda: run_orchestrator(config), config.output_dir, "rl")
    if command == "trainer":
        from asyncrl.trainer.rl import train

        _redirect_rank_output()
        config, flags = cfg.load(cfg.TrainerConfig, argv, frozenset({"--bench"}))
        if "--bench" in flags:
            from asyncrl.trainer.bench import run_bench

            return run_bench(config)
        return _writing(lambda: train(config), config.output_dir, "rl")
    if command == "eval":
        from asyncrl.config.schema import EvalConfig
        from asyncrl.eval_command import run_eval

        return run_eval(cfg.load(EvalConfig, argv)[0])
    if command == "env-server":
        from asyncrl.config.schema import EnvServerConfig
        from asyncrl.env_server.server import serve_environments

        return serve_environments(cfg.load(EnvServerConfig, argv)[0])
    if command == "sft":
        from asyncrl.trainer.sft import train_sft

        config = cfg.load(cfg.SFTConfig, argv)[0]
        return _writing(lambda: train_sft(config), config.output_dir, "sft")
    if command == "dashboard":
        return _dashboard(argv)
    if command == "plot":
        return _plot(argv)
    if command == "plan":
        from asyncrl.plan.command import plan

        return plan(argv)
    if command in ("slurm", "k8s", "run-folder"):
        from asyncrl.clusters import commands

        return {"slurm": commands.slurm, "k8s": commands.k8s, "run-folder": commands.run_folder}[command](argv)
    if command == "model":
        if not argv or argv[0] != "init":
            raise AsyncRLError("usage: asyncrl model init --output DIR [--preset small]")
        return _model_init(argv[1:])
    raise AsyncRLError(f"unknown command '{command}'\n\n{USAGE}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rl":
        passive_openmp_wait()  # before anything imports torch; its processes share the machine's cores
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, rest = argv[0], argv[1:]
    if any(arg in ("-h", "--help") for arg in rest) and command not in ("model", "dashboard", "plot", "plan"):
        from asyncrl.config.reference import COMMANDS, help_text

        if command in COMMANDS:
            print(help_text(command))
            return
        if command not in ("slurm", "k8s", "run-folder"):
            print(f"asyncrl {command}: error: unknown command '{command}'\n\n{USAGE}", file=sys.stderr)
            sys.exit(2)
        print(USAGE)
        return
    if under_torchrun():
        die_with_torchrun_agent()  # torchrun does not stop its ranks when it is killed itself
    try:
        code = _run(command, rest)
    except AsyncRLError as e:
        print(f"asyncrl {command}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"asyncrl {command}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
