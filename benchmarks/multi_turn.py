"""Multi-turn episodes against the native engine, with the prefix cache on and off.

    python benchmarks/multi_turn.py --preset tiny         # CPU, the ~0.1M-parameter model, 64 + 8 x (32 + 16)
    python benchmarks/multi_turn.py --preset qwen3-0.6b   # one GPU, Qwen3-0.6B shape, bf16, 1,024 + 8 x (256 + 64)
    python benchmarks/multi_turn.py --preset qwen3-0.6b --episodes 32 --output multi_turn.json

An agent's or a tool-using environment's episode is a conversation of several turns, and each turn's prompt
is the whole conversation so far: turn 1 is a system + user prompt of `--prompt-tokens` random token ids (below
256, seeded), each turn samples `--new-tokens` tokens (EOS ignored, so lengths are exact; temperature 1, a seed
per episode and turn), and the next turn's prompt is the previous prompt + its completion + `--user-tokens`
random "user / tool" tokens. Without the prefix cache the engine prefills that whole conversation again at
every turn, so prefill work grows with the square of the number of turns; with it (`prefix_cache = true`,
paged layout) a turn finds the previous turn's prompt and sample in the cache, whole blocks of
`kv_block_size` tokens, and prefills only the rest.

`--episodes` episodes run concurrently: every episode's turn k is submitted together, all are awaited, then
turn k + 1. Both configurations (`on`, `off`) use the paged layout and the same settings but the prefix
cache; each runs in a fresh process of its own (`--worker`), so memory and cached blocks never leak from one
to the other. In each, one warm-up round of episodes (seeds of its own, so it fills the cache with nothing
the timed rounds use; CUDA graphs are captured and decoding is compiled before it, at the engine's start)
runs first, then `--repeats` timed rounds, each of fresh random prompts (the cache is reused across turns
only within an episode, never between rounds). Printed per turn (summed over episodes; each figure the
median over the rounds): prompt tokens, prompt tokens served from the cache (`Completion.cached_tokens`;
always 0 with the cache off, which is asserted), prompt tokens prefilled (prompt - cached), and the turn's
latency (from submitting its requests to the last one's completion); then totals: prefilled tokens over
all turns, the episode's time (the median round's sum of turn latencies) and the time to first token
summed over turns, on against off. Last, whether both configurations sampled the same tokens for the same
seeds: exactly so on a CPU in float32 (the cached keys and values equal the recomputed ones to float
rounding); in bf16 on a GPU rounding may flip a token, and from there the episode differs, which is
printed, not treated as a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from inference import Preset, engine_config, peak_memory_gib  # benchmarks/, the script's own folder
from shapes import build_model


@dataclass(frozen=True)
class Workload:
    model: str  # a preset of `asyncrl model init`, or "qwen3-0.6b" (built by shapes.build_model)
    device: str
    dtype: str
    prompt_tokens: int  # turn 1's prompt (system + user)
    new_tokens: int  # sampled per turn
    user_tokens: int  # appended to the conversation before every later turn
    turns: int
    episodes: int  # run concurrently, their turns interleaved
    repeats: int  # timed rounds, after one warm-up round
    threads: int = 0
    engine: dict = field(default_factory=dict)  # engine settings of both configurations

    @property
    def longest_prompt(self) -> int:
        return self.prompt_tokens + (self.turns - 1) * (self.new_tokens + self.user_tokens)


PRESETS = {
    "tiny": Workload(
        "tiny", "cpu", "float32", 64, 32, 16, turns=8, episodes=1, repeats=3, threads=1,
        engine={"kv_block_size": 16, "cuda_graphs": False},
    ),
    "qwen3-0.6b": Workload(
        "qwen3-0.6b", "cuda", "bfloat16", 1024, 256, 64, turns=8, episodes=1, repeats=3,
        engine={"kv_block_size": 16, "cuda_graphs": True},
    ),
}  # fmt: skip
CONFIGS = {"on": True, "off": False}  # the prefix cache of each configuration
WARMUP_ROUND = 1_000  # the warm-up round's seeds lie past every timed round's


def engine_preset(workload: Workload) -> Preset:
    """benchmarks/inference.py's preset of this workload, for its `engine_config`: `seq_len` holds the last
    turn's prompt and completion, and the batch holds every episode."""
    return Preset(
        workload.model, workload.device, workload.dtype, workload.episodes, workload.longest_prompt,
        workload.new_tokens, workload.repeats, hf_repeats=0, threads=workload.threads,
        engine={**workload.engine, "kv_cache_layout": "paged"},
    )  # fmt: skip


def episode_seed(round_index: int, episode: int) -> int:
    return 1 + round_index * 10_000 + episode


def worker(workload: Workload, folder: Path, prefix_cache: bool) -> dict:
    """One configuration in this process: a warm-up round, then the timed rounds; per round and turn the
    figures, and every completion's tokens."""
    from asyncrl.inference.engine.engine import Engine, GenerationRequest

    config = engine_config(
        engine_preset(workload), folder, workload.dtype, workload.episodes, prefix_cache=prefix_cache
    )
    engine = Engine(config)

    def one_round(round_index: int) -> dict:
        seeds = [episode_seed(round_index, episode) for episode in range(workload.episodes)]
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        prompts = [torch.randint(0, 256, (workload.prompt_tokens,), generator=g).tolist() for g in generators]
        turns, tokens = [], []
        for turn in range(workload.turns):
            if turn:
                prompts = [
                    prompt + completion + torch.randint(0, 256, (workload.user_tokens,), generator=g).tolist()
                    for prompt, completion, g in zip(prompts, tokens[-1], generators)
                ]
            requests = [
                GenerationRequest(prompt, max_tokens=workload.new_tokens, temperature=1.0, seed=seed * 1_000 + turn,
                                  ignore_eos=True)
                for prompt, seed in zip(prompts, seeds)
            ]  # fmt: skip
            first_token: dict[int, float] = {}
            hits = engine.stats().prefix_cache_hit_tokens
            start = time.perf_counter()
            futures = []
            for index, request in enumerate(requests):

                def on_token(*_, index=index, first_token=first_token) -> None:
                    first_token.setdefault(index, time.perf_counter())

                futures.append(engine.generate(request, on_token))
            completions = [future.result(3600)[0] for future in futures]
            latency = time.perf_counter() - start
            assert all(len(c.token_ids) == workload.new_tokens for c in completions), "a turn ended early"
            cached = sum(c.cached_tokens for c in completions)
            assert prefix_cache or cached == 0, f"the prefix cache is off, yet turn {turn + 1} read {cached} tokens"
            prompt = sum(map(len, prompts))
            turns.append(
                {
                    "prompt": prompt,
                    "cached": cached,
                    "prefilled": prompt - cached,
                    "hit_tokens": engine.stats().prefix_cache_hit_tokens - hits,  # the engine's own count
                    "latency_s": latency,
                    "ttft_s": statistics.median(first_token[i] - start for i in range(len(requests))),
                }
            )
            tokens.append([c.token_ids for c in completions])
        return {"turns": turns, "tokens": tokens}

    one_round(WARMUP_ROUND)
    preemptions = engine.stats().preemptions
    rounds = [one_round(index) for index in range(workload.repeats)]
    result = {
        "turns": [
            {key: statistics.median(r["turns"][turn][key] for r in rounds) for key in rounds[0]["turns"][turn]}
            for turn in range(workload.turns)
        ],
        "latency_runs_s": [[t["latency_s"] for t in r["turns"]] for r in rounds],
        "episode_s": statistics.median(sum(t["latency_s"] for t in r["turns"]) for r in rounds),
        "ttft_sum_s": statistics.median(sum(t["ttft_s"] for t in r["turns"]) for r in rounds),
        "block_size": engine.cache.block_size,
        "blocks_total": engine.cache.num_blocks,
        "preemptions": engine.stats().preemptions - preemptions,
        "peak_gib": peak_memory_gib(workload.device),
        "tokens": [r["tokens"] for r in rounds],  # [round][turn][episode] -> token ids
    }
    engine.stop()
    return result


def run_worker(name: str, workload: Workload, folder: Path, timeout: float = 3600) -> dict:
    """One configuration in a process of its own; its figures."""
    command = [
        sys.executable,
        __file__,
        "--worker",
        name,
        "--model-dir",
        str(folder),
        "--workload",
        json.dumps(asdict(workload)),
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    output = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=env, timeout=timeout).stdout
    return json.loads(output.strip().splitlines()[-1])


def parity(on: dict, off: dict) -> dict:
    """Whether both configurations sampled the same tokens, completion by completion (a round's episode's
    turn), and the first turn where they did not."""
    pairs = [
        (turn, a == b)
        for round_on, round_off in zip(on["tokens"], off["tokens"])
        for turn, (turn_on, turn_off) in enumerate(zip(round_on, round_off))
        for a, b in zip(turn_on, turn_off)
    ]
    differing = [turn + 1 for turn, same in pairs if not same]
    return {
        "completions": len(pairs),
        "same": len(pairs) - len(differing),
        "matched": not differing,
        "first_differing_turn": min(differing, default=None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--turns", type=int, default=None, help="turns per episode (default: the preset's, 8)")
    parser.add_argument("--episodes", type=int, default=None, help="episodes run concurrently (default: 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds after the warm-up (default: 3)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="turn 1's prompt (default: the preset's)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens sampled per turn (default: the preset's)")
    parser.add_argument("--user-tokens", type=int, default=None, help="tokens added before each later turn")
    parser.add_argument("--model-dir", type=Path, default=None, help="model folder (default: built in a temp dir)")
    parser.add_argument("--output", type=Path, default=None, help="also write the figures as JSON here")
    parser.add_argument("--worker", choices=CONFIGS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workload", default=None, help=argparse.SUPPRESS)  # the worker's, as JSON
    args = parser.parse_args()

    if args.worker is not None:
        workload = Workload(**json.loads(args.workload))
        print(json.dumps(worker(workload, args.model_dir, CONFIGS[args.worker])))
        return

    overrides = {
        "turns": args.turns,
        "episodes": args.episodes,
        "repeats": args.repeats,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "user_tokens": args.user_tokens,
    }
    workload = replace(PRESETS[args.preset], **{key: value for key, value in overrides.items() if value is not None})
    if min(workload.turns, workload.episodes, workload.repeats, workload.prompt_tokens, workload.new_tokens) < 1:
        parser.error("--turns, --episodes, --repeats, --prompt-tokens and --new-tokens must be at least 1")
    scratch = Path(tempfile.gettempdir()) / f"asyncrl-bench-{workload.model}"
    folder = build_model(workload.model, args.model_dir or scratch, workload.device)
    print(f"preset {args.preset}: {asdict(workload)}", flush=True)
    results = {}
    for name in CONFIGS:
        results[name] = run_worker(name, workload, folder)
        summary = {
            key: value for key, value in results[name].items() if key not in ("tokens", "turns", "latency_runs_s")
        }
        print(f"prefix cache {name}: {summary}", flush=True)
    results["parity"] = parity(results["on"], results["off"])
    results["workload"] = asdict(workload)
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))
    print_table(args.preset, workload, results)


def print_table(name: str, workload: Workload, results: dict) -> None:
    on, off = results["on"], results["off"]
    episodes = f"{workload.episodes} episodes" if workload.episodes > 1 else "1 episode"
    print(
        f"\n{name}: {episodes} of {workload.turns} turns, {workload.prompt_tokens} prompt tokens then "
        f"{workload.new_tokens} sampled + {workload.user_tokens} user tokens per turn; blocks of "
        f"{on['block_size']} tokens; medians of {workload.repeats} rounds"
        + (" (tokens summed over episodes)" if workload.episodes > 1 else "")
    )
    header = ("turn", "prompt tokens", "cached (on)", "prefilled (on)", "prefilled (off)", "latency on s",
              "latency off s", "off/on")  # fmt: skip
    print(" | ".join(header))
    widths = [len(column) for column in header]
    for turn, (a, b) in enumerate(zip(on["turns"], off["turns"]), start=1):
        tokens = (a["prompt"], a["cached"], a["prefilled"], b["prefilled"])
        seconds = (a["latency_s"], b["latency_s"])
        cells = [
            str(turn),
            *(f"{n:.0f}" for n in tokens),
            *(f"{s:.3f}" for s in seconds),
            f"{b['latency_s'] / a['latency_s']:.2f}x",
        ]
        print(" | ".join(f"{cell:>{width}}" for cell, width in zip(cells, widths)))
    prefilled_on = sum(t["prefilled"] for t in on["turns"])
    prefilled_off = sum(t["prefilled"] for t in off["turns"])
    print(
        f"prefilled tokens over the episode: on {prefilled_on:.0f}, off {prefilled_off:.0f} "
        f"(off/on {prefilled_off / prefilled_on:.2f}x)"
    )
    print(
        f"episode time: on {on['episode_s']:.3f} s, off {off['episode_s']:.3f} s "
        f"(off/on {off['episode_s'] / on['episode_s']:.2f}x); time to first token summed over turns: on "
        f"{on['ttft_sum_s']:.3f} s, off {off['ttft_sum_s']:.3f} s (off/on {off['ttft_sum_s'] / on['ttft_sum_s']:.2f}x)"
    )
    if on["preemptions"] or off["preemptions"]:
        print(f"preempted samples (timed rounds): on {on['preemptions']}, off {off['preemptions']}")
    check = results["parity"]
    verdict = "the same" if check["matched"] else f"different from turn {check['first_differing_turn']} on"
    print(
        f"completions on vs off (same seeds): {verdict}, {check['same']}/{check['completions']} completions "
        f"identical ({workload.dtype} on {workload.device})"
    )


if __name__ == "__main__":
    main()
