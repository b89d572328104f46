"""What the vLLM backend starts vLLM with (its memory from our keys, its scheduling on a CPU), and how it
reads vLLM's output for the cause of a failure (no vLLM needed)."""

from __future__ import annotations

import io

import pytest

from asyncrl.config.schema import InferenceConfig
from asyncrl.errors import AsyncRLError
from asyncrl.inference.backends.vllm_process import GPU_HEADROOM, VLLMProcess, cpu_scheduling_args, vllm_memory_args
from asyncrl.inference.engine.kv_cache import GIB

TOKEN_BYTES = 114688  # Qwen3-0.6B in bfloat16: 28 layers x 8 KV heads x 128 x 2 (key, value) x 2 bytes
WEIGHTS = int(1.2 * GIB)


def flags(args: list[str]) -> dict[str, str]:
    return dict(zip(args[::2], args[1::2]))


def test_on_a_cpu_the_kv_cache_is_what_the_batch_needs_at_most_2_gib():
    small = flags(vllm_memory_args(InferenceConfig(max_batch_size=4, seq_len=1024), TOKEN_BYTES, WEIGHTS, None))
    assert small == {"--kv-cache-memory-bytes": str(4 * 1024 * TOKEN_BYTES), "--max-num-seqs": "4"}
    default = flags(vllm_memory_args(InferenceConfig(), TOKEN_BYTES, WEIGHTS, None))
    assert default["--kv-cache-memory-bytes"] == str(2 * GIB) and "--gpu-memory-utilization" not in default


def test_kv_cache_gb_sets_it():
    args = flags(vllm_memory_args(InferenceConfig(kv_cache_gb=0.5), TOKEN_BYTES, WEIGHTS, None))
    assert args["--kv-cache-memory-bytes"] == str(GIB // 2)


def test_on_a_shared_gpu_vllm_takes_what_it_needs_not_92_percent():
    total, free = 141 * GIB, 100 * GIB  # a trainer already holds 41 GiB
    args = flags(vllm_memory_args(InferenceConfig(), TOKEN_BYTES, WEIGHTS, (free, total)))
    kv = int(args["--kv-cache-memory-bytes"])
    assert kv == 256 * 2048 * TOKEN_BYTES  # what 256 sequences of 2048 tokens need (56 GiB), below 80% of free
    fraction = float(args["--gpu-memory-utilization"])
    assert fraction * total == pytest.approx(WEIGHTS + kv + GPU_HEADROOM, rel=1e-3)
    assert fraction * total <= free  # vLLM's start-up check passes
    crowded = flags(vllm_memory_args(InferenceConfig(), TOKEN_BYTES, WEIGHTS, (20 * GIB, total)))
    assert int(crowded["--kv-cache-memory-bytes"]) == int(0.8 * (20 * GIB - WEIGHTS))


def test_a_budget_below_one_sequence_is_refused_with_the_fix():
    with pytest.raises(AsyncRLError, match="raise inference.kv_cache_gb or lower inference.seq_len"):
        vllm_memory_args(InferenceConfig(kv_cache_gb=0.001, seq_len=4096), TOKEN_BYTES, WEIGHTS, None)


def test_on_a_cpu_no_prefill_is_split_and_the_budget_holds_the_longest_prompt():
    # a split prefill makes vLLM rewind a seeded request's generator, which a CPU generator cannot do
    assert cpu_scheduling_args(InferenceConfig(seq_len=512)) == [
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"
    ]  # fmt: skip
    assert cpu_scheduling_args(InferenceConfig(seq_len=8192))[-1] == "8192"


def test_the_newest_exception_vllm_printed_names_its_failure(capsysbinary):
    output = b"""(APIServer pid=1) WARNING [system_utils.py:255] errors like `OSError: [Errno 24] Too many open files`
(Worker pid=7) ERROR 12-04 23:12:09 [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker pid=7) ERROR 12-04 23:12:09 [multiproc_executor.py:1063] RuntimeError: CPU Generator does not use offset
(APIServer pid=1) ERROR 12-04 23:12:09 [vllm_error.py:54] vllm.v1.engine.exceptions.EngineDeadError: see above
INFO:     Shutting down
"""
    child = VLLMProcess(InferenceConfig())
    assert child.why() == " (its output is above)"
    child._relay(io.BytesIO(output))
    assert child.last_error == "RuntimeError: CPU Generator does not use offset"
    assert child.why() == "; its last error: RuntimeError: CPU Generator does not use offset (its output is above)"
    assert capsysbinary.readouterr().out == output  # passed on unchanged
