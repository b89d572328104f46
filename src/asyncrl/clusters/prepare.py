"""Preparing the run folder of a cluster job, once, on its first node, before any process starts: a new run,
or (with `resume`, or after a requeue) the run rewound to its newest whole checkpoint as `asyncrl rl --resume`
does; then every process's config in configs/; then, last, the job's token that every node checks
(run_folder.py)."""

from __future__ import annotations

from pathlib import Path

from asyncrl import checkpoints
from asyncrl.clusters import run_folder
from asyncrl.clusters.layout import process_configs
from asyncrl.config import RLConfig, write_toml
from asyncrl.config.schema import ResumeConfig
from asyncrl.errors import AsyncRLError
from asyncrl.output_dir import prepare_output_dir, resume_run


def prepare(cfg: RLConfig, clean: bool = False, requeued: bool = False) -> int | None:
    """Make the run folder ready and write configs/; returns the checkpoint step the run resumes from, if any.
    A requeued job resumes from its newest whole checkpoint, or starts over when it has none yet."""
    token = run_folder.job_token()
    output_dir = Path(cfg.output_dir)
    step = None
    if requeued and _has_whole_checkpoint(output_dir):
        step = resume_run(output_dir, None, cfg.max_steps, clean=False)
    elif requeued:
        print(f"requeued before the first checkpoint: starting {output_dir} over", flush=True)
        prepare_output_dir(output_dir, clean=True)
    elif cfg.resume is not None:
        step = resume_run(output_dir, cfg.resume.step, cfg.max_steps, clean)
    else:
        prepare_output_dir(output_dir, clean)
    configs = process_configs(cfg)
    for name in ("orchestrator", "trainer"):
        configs[name].resume = ResumeConfig(step=step) if step is not None else None
    for name, config in configs.items():
        write_toml(config, output_dir / "configs" / f"{name}.toml")
    write_toml(cfg, output_dir / "configs" / "rl.toml")
    run_folder.mark(output_dir, token)
    return step


def _has_whole_checkpoint(output_dir: Path) -> bool:
    try:
        checkpoints.find_resume_step(output_dir, checkpoints.RL_PARTS, None)
    except AsyncRLError:
        return False
    return True
