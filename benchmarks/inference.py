"""Generation speed of the native engine against Hugging Face `generate` (and a vLLM server), in one run.

    python benchmarks/inference.py --preset tiny            # CPU, ~0.1M parameters
    python benchmarks/inference.py --preset 30m             # CPU, ~32M parameters
    python benchmarks/inference.py --preset qwen3-0.6b      # one GPU, Qwen3-0.6B shape, bf16, 128 x 256
    python benchmarks/inference.py --preset 30m --vllm-url http://127.0.0.1:8001

Every backend gets the same prompts (random token ids, one request each) and the same sampling
(temperature 1, no top-k / top-p); each runs in a fresh process (so its peak memory is its own), once to
warm up (CUDA graphs are captured then), then `--repeats` timed runs. Printed per backend: generated tokens
per second (median of the runs; only tokens up to each sample's EOS count), time to first token (median
over requests: the engine's first streamed token; for Hugging Face, a `generate` of one new token), peak
memory (GPU: allocated by torch; CPU: the process's peak resident set), and the ratio to Hugging Face.
On a GPU the engine also runs as `GPU_VARIANTS` set it (torch's flash attention instead of our Triton
decoding kernel; no compiled decoding step), so what each part gains shows side by side.
A parity check follows: the engine's sampled-token logprobs against a teacher-forced Hugging Face forward
of the same weights (float32: max abs difference; the preset's dtype: mismatch KL, mean of rho - r - 1).
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
import time
from dataclasses import asdict, dataclass
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
    hf_repeats: int  # timed runs of Hugging Face `generate`
    threads: int = 0


PRESETS = {
    "tiny": Preset("tiny", "cpu", "float32", 64, 16, 64, repeats=3, hf_repeats=3, threads=1),
    "30m": Preset("30m", "cpu", "float32", 64, 32, 64, repeats=3, hf_repeats=3, threads=1),
    "qwen3-0.6b": Preset("qwen3-0.6b", "cuda", "bfloat16", 128, 128, 256, repeats=3, hf_repeats=3),
}


def make_prompts(preset: Preset) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (preset.prompts, preset.prompt_len), generator=generator).tolist()


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


def engine_config(preset: Preset, folder: Path, dtype: str, max_batch_size: int, **settings):
    from asyncrl.config.schema import InferenceConfig

    return InferenceConfig(
        model={"name": str(folder), "dtype": dtype},
        device=preset.device,
        seq_len=preset.prompt_len + preset.new_tokens,
        max_batch_size=max_batch_size,
        num_threads=preset.threads,
        **settings,
    )


def native_worker(preset: Preset, folder: Path, repeats: int, settings: dict) -> dict:
    from asyncrl.inference.engine import Engine, GenerationRequest

    engine = Engine(engine_config(preset, folder, preset.dtype, preset.prompts, **settings))
    prompts = make_prompts(preset)

    def one_run(seed: int) -> tuple[float, float, int]:
        first_token: dict[int, float] = {}
        start = time.perf_counter()
        futures = []
        for index, prompt in enumerate(prompts):

            def on_token(*_, index=index) -> None:
                first_token.setdefault(index, time.perf_counter())

            request = GenerationRequest(prompt, max_tokens=preset.new_tokens, temperature=1.0, seed=seed + index)
            futures.append(engine.generate(request, on_token))
        completions = [future.result(3600)[0] for future in futures]
        elapsed = time.perf_counter() - start
        ttft = statistics.median(first_token[i] - start for i in range(len(prompts)))
        return elapsed, ttft, sum(len(c.token_ids) for c in completions)

    one_run(seed=10_000)  # warm-up: decoding is compiled (GPU) and CUDA graphs are captured here
    runs = [one_run(seed=run * len(prompts)) for run in range(repeats)]
    engine.stop()
    return {
        "tok_s": [tokens / elapsed for elapsed, _, tokens in runs],
        "ttft_s": statistics.median(ttft for _, ttft, _ in runs),
        "tokens": runs[-1][2],
        "peak_gib": peak_memory_gib(preset.device),
    }


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
    from asyncrl.inference.engine import Engine, GenerationRequest

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
    """Every prompt as its own /v1/completions request (token ids in), all in flight at once."""
    import asyncio

    import httpx

    prompts = make_prompts(preset)

    async def one_run(client: httpx.AsyncClient, model: str, seed: int) -> float:
        async def one(index: int, prompt: list[int]) -> int:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": preset.new_tokens,
                "temperature": 1.0,
                "top_p": 1.0,
                "seed": seed + index,
            }
            response = await client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return sum(tokens) / (time.perf_counter() - start)

    async def main() -> list[float]:
        async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=len(prompts))) as client:
            model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
            await one_run(client, model, seed=10_000)
            return [await one_run(client, model, seed=run * len(prompts)) for run in range(repeats)]

    return {"tok_s": asyncio.run(main()), "ttft_s": None, "peak_gib": None}


def run_worker(kind: str, args: argparse.Namespace, folder: Path) -> dict:
    command = [sys.executable, __file__, "--preset", args.preset, "--worker", kind, "--model-dir", str(folder)]
    command += ["--repeats", str(args.repeats or PRESETS[args.preset].repeats)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    output = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per backend (default: the preset's)")
    parser.add_argument("--vllm-url", default=None, help="also measure a vLLM server serving the same model folder")
    parser.add_argument("--model-dir", type=Path, default=None, help="model folder (default: built in a temp dir)")
    parser.add_argument("--output", type=Path, default=None, help="also write the figures as JSON here")
    workers = ["native", *GPU_VARIANTS, "hf", "parity"]
    parser.add_argument("--worker", choices=workers, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    preset = PRESETS[args.preset]

    if args.worker is not None:
        repeats = args.repeats or preset.repeats
        if args.worker == "native" or args.worker in GPU_VARIANTS:
            result = native_worker(preset, args.model_dir, repeats, GPU_VARIANTS.get(args.worker, {}))
        elif args.worker == "hf":
            result = hf_worker(preset, args.model_dir, min(repeats, preset.hf_repeats))
        else:
            result = parity_worker(preset, args.model_dir)
        print(json.dumps(result))
        return

    scratch = Path(tempfile.gettempdir()) / f"asyncrl-bench-{args.preset}"
    folder = build_model(preset.model, args.model_dir or scratch, preset.device)
    print(f"preset {args.preset}: {asdict(preset)}", flush=True)
    results = {"native": run_worker("native", args, folder)}
    print(f"native: {results['native']}", flush=True)
    for variant in GPU_VARIANTS if preset.device == "cuda" else []:
        results[variant] = run_worker(variant, args, folder)
        print(f"{variant}: {results[variant]}", flush=True)
    results["parity"] = run_worker("parity", args, folder)
    print(f"parity: {results['parity']}", flush=True)
    if args.vllm_url:
        results["vllm"] = vllm_run(preset, args.vllm_url, args.repeats or preset.repeats)
        print(f"vllm: {results['vllm']}", flush=True)
    results["hf"] = run_worker("hf", args, folder)
    print(f"hf: {results['hf']}", flush=True)

    hf_speed = statistics.median(results["hf"]["tok_s"])
    print(f"\n{args.preset}: {preset.prompts} prompts x {preset.prompt_len} tokens -> {preset.new_tokens} new tokens")
    print(f"{'backend':<12} {'tok/s':>10} {'runs':>5} {'TTFT s':>8} {'peak GiB':>9} {'vs HF':>7}")
    for name in ("native", *GPU_VARIANTS, "vllm", "hf"):
        if name not in results:
            continue
        figures = results[name]
        speed = statistics.median(figures["tok_s"])
        ttft = "-" if figures["ttft_s"] is None else f"{figures['ttft_s']:.3f}"
        peak = "-" if figures["peak_gib"] is None else f"{figures['peak_gib']:.2f}"
        print(f"{name:<12} {speed:>10.0f} {len(figures['tok_s']):>5} {ttft:>8} {peak:>9} {speed / hf_speed:>6.1f}x")
    for dtype, figures in results["parity"].items():
        print(
            f"parity {dtype}: max |logprob diff| {figures['max_abs_diff']:.2e}, "
            f"mismatch KL {figures['mismatch_kl']:.2e} over {figures['tokens']} tokens"
        )
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
