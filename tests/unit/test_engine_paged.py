"""The engine with the paged KV cache on a tiny model gives exactly the samples of the slots layout: seeded
tokens and logprobs, with a request's samples sharing their prompt's blocks, and with samples preempted and
recomputed under a budget of a few blocks; every block is free again at the end."""

from __future__ import annotations

import os

import pytest
import torch

from asyncrl.config.schema import InferenceConfig
from asyncrl.errors import AsyncRLError
from asyncrl.inference.backends.native_backend import engine_metrics
from asyncrl.inference.engine.engine import Engine, GenerationRequest
from asyncrl.inference.engine.kv_cache import GIB
from asyncrl.inference.kernels.triton_import import AVAILABLE as TRITON
from asyncrl.models.offline import init_model

TIMEOUT = 120
TOKEN_BYTES = 512  # the tiny model: 2 layers x 1 KV head of 32 x key and value x float32
SEQ_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("paged") / "tiny"
    init_model(path, "tiny", seed=0)
    return path


def config(model_dir, **fields) -> InferenceConfig:
    fields.setdefault("device", "cpu")  # the same test on a GPU host
    return InferenceConfig(
        model={"name": str(model_dir), "dtype": "float32"},
        seq_len=SEQ_LEN,
        max_batch_size=8,
        num_threads=1,
        **{"cuda_graphs": False, **fields},
    )


def requests() -> list[GenerationRequest]:
    """Samples sharing a prompt that ends inside a block and one that fills its blocks; stop tokens end
    samples at scattered steps; more samples than the batch holds at once."""
    stops = tuple(range(3, 259, 9))
    return [
        GenerationRequest([5, 6, 7], n=1, max_tokens=20, seed=0),
        GenerationRequest(list(range(40, 53)), n=4, max_tokens=40, seed=10, stop_token_ids=stops),
        GenerationRequest(list(range(90, 98)), n=3, max_tokens=30, seed=20, temperature=0.7),
        GenerationRequest([1, 2, 3, 4, 5], n=2, max_tokens=45, seed=30),
    ]


def generate(model_dir, decode_ahead: bool = False, **fields) -> tuple[list, Engine]:
    """The samples of `requests()`; with `decode_ahead`, decoding one step ahead as on a GPU (the engine
    counts in `steps_ahead` the steps it launched so)."""
    engine = Engine(config(model_dir, **fields))
    engine.decode_ahead = decode_ahead
    engine.steps_ahead = 0
    decode_ahead_step = engine._decode_paged_ahead

    def counted(previous):
        engine.steps_ahead += 1
        return decode_ahead_step(previous)

    engine._decode_paged_ahead = counted
    try:
        futures = [engine.generate(request) for request in requests()]
        return [future.result(TIMEOUT) for future in futures], engine
    finally:
        engine.stop()


AHEAD = pytest.mark.parametrize("decode_ahead", [False, True], ids=["step-by-step", "one-step-ahead"])


@pytest.fixture(scope="module")
def slots_completions(model_dir):
    return generate(model_dir, kv_cache_layout="slots")[0]


def assert_same_samples(actual, expected, logprob_tolerance: float = 0.0) -> None:
    for actual_request, expected_request in zip(actual, expected, strict=True):
        for a, b in zip(actual_request, expected_request, strict=True):
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=logprob_tolerance, rel=0)
            assert a.finish_reason == b.finish_reason


@AHEAD
def test_paged_samples_equal_the_slots_layouts_and_every_block_is_freed(model_dir, slots_completions, decode_ahead):
    paged, engine = generate(model_dir, decode_ahead, kv_cache_layout="paged", kv_block_size=4)
    # One step ahead, a step also decodes the rows of samples that ended with the step before it: another
    # batch size and context, so float32 sums round differently (the same tokens, logprobs to 1e-5).
    assert_same_samples(paged, slots_completions, logprob_tolerance=1e-5 if decode_ahead else 0.0)
    assert (engine.steps_ahead > 0) == decode_ahead
    stats = engine.stats()
    assert stats.kv_cache_blocks_used == 0 and engine.scheduler.blocks.pool.num_free == stats.kv_cache_blocks_total
    assert stats.preemptions == 0
    lengths = {len(c.token_ids) for request in paged for c in request}
    assert len(lengths) > 2  # samples did end at scattered steps


def test_samples_of_a_request_hold_their_prompt_once(model_dir):
    engine = Engine(config(model_dir, kv_cache_layout="paged", kv_block_size=4))
    try:
        engine.pause().result(TIMEOUT)
        future = engine.generate(GenerationRequest(list(range(40, 53)), n=4, max_tokens=1, seed=0))
        used = []
        engine.runner.decode_paged = lambda *args: used.append(engine.stats().kv_cache_blocks_used)  # never run
        real_prefill = engine.runner.prefill_paged

        def prefill(prompts, tables, **routed):
            used.append(engine.scheduler.blocks.pool.num_used)
            return real_prefill(prompts, tables, **routed)

        engine.runner.prefill_paged = prefill
        engine.resume().result(TIMEOUT)
        assert len(future.result(TIMEOUT)) == 4  # max_tokens 1: done after the prefill, before any decoding
    finally:
        engine.stop()
    assert used == [4]  # 13 prompt tokens: 4 blocks of 4, once for the 4 samples (not 16)


@AHEAD
def test_preempted_samples_are_recomputed_to_the_same_tokens(model_dir, slots_completions, decode_ahead):
    """Blocks for little more than one sequence of seq_len: samples are preempted mid-decode, wait, and are
    prefilled again with what they had, and still sample the tokens they would have. Their recomputed keys
    and values come from a prefill, not from decoding steps, so the logprobs after it agree to float32
    rounding, not bit for bit. One step ahead, a step that would need blocks nobody has freed yet is not
    launched ahead: the step in flight is read first, and then the newest samples are preempted."""
    block_size = 4
    budget = (SEQ_LEN // block_size + 6) * block_size * TOKEN_BYTES / GIB
    paged, engine = generate(
        model_dir, decode_ahead, kv_cache_layout="paged", kv_block_size=block_size, kv_cache_gb=budget
    )
    assert engine.stats().kv_cache_blocks_total == SEQ_LEN // block_size + 6
    assert engine.stats().preemptions > 0, "no sample was preempted: the test lost its point"
    assert (engine.steps_ahead > 0) == decode_ahead
    assert_same_samples(paged, slots_completions, logprob_tolerance=1e-5)
    stats = engine.stats()
    assert stats.kv_cache_blocks_used == 0
    metrics = engine_metrics(stats)
    assert f"asyncrl_inference_preemptions_total {stats.preemptions}\n" in metrics
    assert "asyncrl_inference_kv_cache_blocks_used 0\n" in metrics
    assert f"asyncrl_inference_kv_cache_blocks_total {SEQ_LEN // block_size + 6}\n" in metrics


def test_a_budget_below_one_sequence_of_blocks_is_refused(model_dir):
    budget = (SEQ_LEN // 16 - 1) * 16 * TOKEN_BYTES / GIB
    with pytest.raises(AsyncRLError, match="fewer than one sequence of seq_len 64 tokens needs"):
        Engine(config(model_dir, kv_cache_layout="paged", kv_cache_gb=budget))


@pytest.mark.skipif(
    not TRITON or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the Triton paged kernel on CPU under TRITON_INTERPRET=1 (set before pytest starts); on a GPU "
    "its float32 products are tf32, which test_paged_decode_attention.py checks with their tolerance",
)
def test_the_triton_paged_kernel_samples_what_the_slots_layout_does(model_dir, slots_completions):
    budget = (SEQ_LEN // 4 + 6) * 4 * TOKEN_BYTES / GIB  # preemptions too
    paged, engine = generate(
        model_dir, kv_cache_layout="paged", kv_block_size=4, decode_attention="triton", kv_cache_gb=budget
    )
    assert engine.runner.attention == "triton" and engine.stats().preemptions > 0
    assert_same_samples(paged, slots_completions, logprob_tolerance=1e-4)
    assert engine.stats().kv_cache_blocks_used == 0


@pytest.mark.skipif(not torch.cuda.is_available() or not TRITON, reason="decodes from CUDA graphs on a CUDA GPU")
def test_on_a_gpu_decoding_one_step_ahead_samples_what_step_by_step_does(model_dir):
    """The GPU path: the Triton paged kernel replayed from CUDA graphs, with preemptions. float32, so that the
    rows a step launched ahead decodes for samples that just ended change nothing but rounding."""
    budget = (SEQ_LEN // 4 + 6) * 4 * TOKEN_BYTES / GIB
    fields = dict(
        device="cuda", kv_cache_layout="paged", kv_block_size=4, decode_attention="triton", cuda_graphs=True,
        compile=False, kv_cache_gb=budget,
    )  # fmt: skip
    ahead, engine = generate(model_dir, True, **fields)
    assert engine.steps_ahead > 0 and engine.stats().preemptions > 0
    assert engine.stats().kv_cache_blocks_used == 0
    step_by_step, engine = generate(model_dir, False, **fields)
    assert engine.steps_ahead == 0
    assert_same_samples(ahead, step_by_step, logprob_tolerance=1e-4)
