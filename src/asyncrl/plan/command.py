"""`asyncrl plan`: the predicted table of GPU splits, from a parts file or calibrated on a run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from asyncrl.errors import AsyncRLError
from asyncrl.plan.calibrate import calibrate, layout, measured_step_s
from asyncrl.plan.model import best_splits, load_parts, parts_file, predict, table


def plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="asyncrl plan",
        description="Predict seconds per step, trained tokens/s and each side's idle time for every split of "
        "N GPUs between inference and trainer, from measured parts (a model: docs/clusters.md says what it "
        "leaves out).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--parts", type=Path, help="a JSON or TOML parts file (examples/plan/)")
    source.add_argument("--calibrate", type=Path, metavar="RUN_DIR", help="read the parts from a finished run")
    parser.add_argument("--gpus", type=int, help="GPUs to split (with --calibrate: also print the parts)")
    parser.add_argument("--mode", default="filesystem", help="weight transfer of the separate splits")
    parser.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    parser.add_argument("--skip", type=int, default=2, help="--calibrate: start-up steps left out (default 2)")
    args = parser.parse_args(argv)
    if args.calibrate is not None:
        parts = calibrate(args.calibrate, args.skip)
        mode = next(iter(parts.publish))
        print(json.dumps(parts_file(parts), indent=2))
        run = predict(parts, *layout(args.calibrate), mode)
        print(
            f"this run: predicted {run.step_s:.3f} s/step ({run.bound} bound), "
            f"measured {measured_step_s(args.calibrate, args.skip):.3f} s/step"
        )
        if args.gpus is None:
            return 0
    else:
        if args.gpus is None:
            raise AsyncRLError("--parts needs --gpus N (the GPUs to split)")
        parts, mode = load_parts(args.parts), args.mode
    print(f"PREDICTION for {args.gpus} GPUs, max_async_level {parts.max_async_level}, {mode} transfer:")
    print(table(best_splits(parts, args.gpus, mode), args.top))
    return 0
