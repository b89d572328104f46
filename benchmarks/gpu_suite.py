"""The recorded GPU figures in one command within a time budget (default 8 minutes, one H200).

    python benchmarks/gpu_suite.py [--budget 480] [--out DIR] [--only STEP ...]

Runs `STEPS` in order, each in a fresh process, and skips what the budget no longer holds (said so at the
end; `--only` runs those later):

- `check`: `benchmarks/trainer.py`'s attention check: cuDNN and flash on one-document rows against float32
  attention, and their speed on one layer at 16,384 and 65,536 tokens;
- `rl-64k-best`, `sft-8k-best`, `rl-16k-best`: the trainer on prime-rl's rows (one document per row, two
  rows per step) with our best settings (no recompute, compiled);
- `batch-native`, `batch-hf`: the engine at 128 prompts x 256 new tokens, and a warm Hugging Face
  `generate` on the same prompts (median of three each);
- `rl-64k-prime`, `sft-8k-prime`, `rl-16k-prime`: the trainer rows with full activation recompute, as
  prime-rl's published rows ran;
- `rl-shape`: the RL-shape engine workload (64 prompts x 8 samples, up to 2,048 new tokens; one timed run);
- `rl-64k-selective`: only if `rl-64k-best` failed (out of memory): every other layer recomputed;
- `rl-shape-copies`: the RL shape without prompt sharing.

Prints each result as it comes, then one table; with --out, also writes suite.json there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import inference  # benchmarks/, the script's own folder
import trainer
from shapes import build_model

# seconds: (at least, at most) a step may take
CHECK = (20, 90)
TRAINER_ROW = {"rl-64k": (70, 170), "sft-8k": (40, 100), "rl-16k": (40, 100)}
ENGINE = (45, 150)
HF = (40, 120)
RL_SHAPE = (60, 180)
ROWS = {"rl-64k": "RL 65,536", "sft-8k": "SFT 8,192", "rl-16k": "RL 16,384"}
GOALS = {"rl-64k": 20_000, "sft-8k": 52_000, "rl-16k": 24_000}


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def timeout(self, bounds: tuple[float, float]) -> float | None:
        """The time a step may take now, or None when less than its minimum is left."""
        left = self.deadline - time.monotonic()
        return min(bounds[1], left) if left >= bounds[0] else None


# The steps in the order they run (most wanted first: a tight budget drops the last).
STEPS = [
    "check", "rl-64k-best", "sft-8k-best", "rl-16k-best", "batch-native", "batch-hf", "rl-64k-prime",
    "sft-8k-prime", "rl-shape", "rl-16k-prime", "rl-64k-selective", "rl-shape-copies",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=480, help="seconds for the whole suite")
    parser.add_argument("--out", type=Path, help="folder for suite.json")
    parser.add_argument("--only", nargs="+", choices=STEPS, help="run these steps only (e.g. what a run skipped)")
    parser.add_argument(
        "--engine-presets", nargs=2, default=["qwen3-0.6b", "rl-shape"], metavar=("BATCH", "RL"),
        help="benchmarks/inference.py presets of the engine steps (others only to try the suite out)",
    )  # fmt: skip
    args = parser.parse_args()
    batch_preset, rl_preset = args.engine_presets
    start = time.monotonic()
    budget = Budget(args.budget)
    results: dict = {"trainer": {}, "skipped": []}

    def record() -> None:
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "suite.json").write_text(json.dumps(results, indent=1))

    with tempfile.TemporaryDirectory() as scratch:
        shape = trainer.write_shape(Path(scratch) / "qwen3-0.6b-config")
        trainer_args = SimpleNamespace(steps=3, warmup_steps=2, nproc=1, threads=0)
        folder = None

        def model_folder(preset: str) -> Path:
            nonlocal folder
            if folder is None:
                model = inference.PRESETS[preset]
                folder = build_model(model.model, Path(scratch) / model.model, model.device)
            return folder

        for step in args.only or STEPS:
            if (
                step == "rl-64k-selective"
                and not args.only
                and "error" not in results["trainer"].get("rl-64k-best", {})
            ):
                continue  # only where rl-64k-best ran out of memory
            if step == "check":
                timeout = budget.timeout(CHECK)
                if timeout is None:
                    results["skipped"].append(step)
                else:
                    results["attention"] = trainer.run_check(timeout)
            elif step.startswith(("rl-64k", "sft-8k", "rl-16k")):
                row = step.rsplit("-", 1)[0]
                timeout = budget.timeout(TRAINER_ROW[row])
                if timeout is None:
                    results["skipped"].append(step)
                    continue
                case = trainer.LIKE_FOR_LIKE_CASES[step]
                results["trainer"][step] = trainer.run_case(step, case, shape, trainer_args, "bfloat16", timeout)
            elif step.startswith("batch"):
                kind = step.removeprefix("batch-")
                bounds = ENGINE if kind == "native" else HF
                engine_step(results, budget, kind, bounds, batch_preset, 3, model_folder(batch_preset))
            else:
                kind = "native-copies" if step == "rl-shape-copies" else "native"
                engine_step(results, budget, kind, RL_SHAPE, rl_preset, 1, model_folder(rl_preset))
            record()

    results["wall_s"] = time.monotonic() - start
    record()
    print_table(results)


def engine_step(results: dict, budget: Budget, kind: str, bounds, preset: str, repeats: int, folder: Path) -> None:
    key = f"{'rl-shape' if inference.PRESETS[preset].n > 1 else 'batch'} {kind}"
    timeout = budget.timeout(bounds)
    if timeout is None:
        results["skipped"].append(key)
        return
    try:
        figures = inference.run_worker(kind, SimpleNamespace(preset=preset, repeats=repeats), folder, timeout)
    except Exception as error:  # noqa: BLE001 - one failed step must not lose the others' figures
        figures = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    results[key] = figures
    print(f"{key}: {inference.summary(figures)}", flush=True)


def print_table(results: dict) -> None:
    print("\nTrainer, one GPU, Qwen3-0.6B shape, prime-rl's rows: one document per row, two rows per step")
    print("| row | settings | tokens/s | MFU | peak GiB | prime-rl, one H100 | ratio | goal |")
    print("|---|---|---|---|---|---|---|---|")
    for row, label in ROWS.items():
        theirs, their_mfu = trainer.PRIME_RL[row]
        for kind, settings in (("prime", "full recompute"), ("best", "no recompute"), ("selective", "selective")):
            figures = results["trainer"].get(f"{row}-{kind}")
            if figures is None:
                continue
            if "error" in figures:
                print(f"| {label} | {settings} | {figures['error']} | | | | | |")
                continue
            speed, kernel = figures["tokens_per_s"], figures.get("row_attention_kernel", "?")
            goal = f">= {GOALS[row] // 1000}k: {'met' if speed >= GOALS[row] else 'not met'}" if kind != "prime" else ""
            mfu = f"{figures['mfu']:.1%}" if figures.get("mfu") is not None else "n/a"
            settings += ", compile" if figures.get("compile") else ""
            print(
                f"| {label} | {settings}, {kernel} | {speed:,.0f} | {mfu} | "
                f"{figures['peak_memory_gib']:.1f} | {theirs:,} ({their_mfu}%) | {speed / theirs:.2f}x | {goal} |"
            )
    attention = results.get("attention", {})
    if attention and "error" not in attention:
        speeds = ", ".join(
            f"{key.removeprefix('tflops ')} {value:.0f}" for key, value in attention.items() if "tflops" in key
        )
        errors = ", ".join(
            f"{key.removeprefix('error ')} {value:.1e}" for key, value in attention.items() if "error" in key
        )
        print(f"attention, one layer fwd+bwd, TFLOP/s: {speeds}\nattention, max rel. error vs float32: {errors}")
    elif attention:
        print(f"attention check: {attention['error']}")

    native, hf = results.get("batch native", {}), results.get("batch hf", {})
    if "tok_s" in native:
        line = f"\nengine, 128 x 256: native {statistics.median(native['tok_s']):,.0f} tok/s ({fmt(native['tok_s'])})"
        line += f", bound {inference.bound_of(native, inference.H200_BANDWIDTH):,.0f}"
        if "tok_s" in hf:
            ratio = statistics.median(native["tok_s"]) / statistics.median(hf["tok_s"])
            line += f"; HF generate (warm) {statistics.median(hf['tok_s']):,.0f} ({fmt(hf['tok_s'])}): {ratio:.1f}x"
        print(line)
    for kind in ("native", "native-copies"):
        figures = results.get(f"rl-shape {kind}", {})
        if "tok_s" in figures:
            lengths = [length for request in figures["sample_lengths"] for length in request]
            bound = inference.bound_of(figures, inference.H200_BANDWIDTH)
            speed = statistics.median(figures["tok_s"])
            print(
                f"rl-shape {kind}, 64 x 8 ({'prompts shared' if figures['shares_prompts'] else 'prompt copies'}): "
                f"{speed:,.0f} tok/s, bound {bound:,.0f} ({speed / bound:.0%}), {figures['slots']} slots, "
                f"mean length {statistics.mean(lengths):.0f}, TTFT {figures['ttft_s']:.2f} s, "
                f"peak {figures['peak_gib']:.1f} GiB"
            )
    for key in ("batch native", "batch hf", "rl-shape native", "rl-shape native-copies"):
        if "error" in results.get(key, {}):
            print(f"{key}: {results[key]['error']}")
    if results["skipped"]:
        print(f"skipped (budget): {', '.join(results['skipped'])}")
    print(f"suite wall time {results['wall_s']:.0f} s")


def fmt(values: list[float]) -> str:
    return " / ".join(f"{value:,.0f}" for value in values)


if __name__ == "__main__":
    sys.exit(main())
