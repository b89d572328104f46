"""The cluster commands: `asyncrl slurm`, `asyncrl k8s`, and `asyncrl run-folder prepare|check`, which the
rendered script and manifests run on the nodes."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

from asyncrl.config import RLConfig
from asyncrl.config.loader import build, parse_args, share_rl_keys
from asyncrl.errors import AsyncRLError


def load_as_given(argv: list[str], command_flags: frozenset[str]) -> tuple[RLConfig, dict[str, Any], list[str]]:
    """The built config, the config as given (files and flags merged, before the shared keys are copied into
    the sections: the job adds its own flags to it), and the command's flags."""
    raw, flags = parse_args(argv, command_flags)
    return build(RLConfig, share_rl_keys(copy.deepcopy(raw))), raw, flags


def slurm(argv: list[str]) -> int:
    from asyncrl.clusters import slurm as renderer

    cfg, raw, flags = load_as_given(argv, frozenset({"--submit", "--clean"}))
    script = renderer.render(cfg, raw, clean="--clean" in flags)
    if "--submit" in flags:
        print(renderer.submit(script))
    else:
        print(script, end="")
    return 0


def k8s(argv: list[str]) -> int:
    from asyncrl.clusters import k8s as renderer

    cfg, raw, flags = load_as_given(argv, frozenset({"--clean"}))
    print(renderer.render(cfg, raw, clean="--clean" in flags), end="")
    return 0


def run_folder(argv: list[str]) -> int:
    from asyncrl.clusters import run_folder as folder

    if argv[:1] == ["prepare"]:
        from asyncrl.clusters.prepare import prepare

        cfg, _, flags = load_as_given(argv[1:], frozenset({"--clean", "--requeued"}))
        prepare(cfg, clean="--clean" in flags, requeued="--requeued" in flags)
        return 0
    if argv[:1] == ["check"]:
        parser = argparse.ArgumentParser(prog="asyncrl run-folder check")
        parser.add_argument("output_dir", type=Path)
        parser.add_argument("--timeout", type=float, default=300.0)
        args = parser.parse_args(argv[1:])
        folder.check(args.output_dir, folder.job_token(), args.timeout)
        return 0
    raise AsyncRLError(
        "usage: asyncrl run-folder prepare @ rl.toml [--clean] [--requeued] | asyncrl run-folder check DIR "
        "[--timeout S] (the job script and manifests run these on the nodes)"
    )
