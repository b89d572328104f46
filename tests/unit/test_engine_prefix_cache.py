"""The engine's prefix cache on a tiny model (float32, CPU): a request sharing whole blocks with an earlier
prompt, or with an earlier sample (a second turn), prefills only the rest and still samples exactly what it
samples with the cache off, greedy or seeded (logprobs within 1e-5: the cached keys and values came from
another prefill or from decoding steps); a weight update in between leaves nothing to hit; /metrics counts
the hits and the cached blocks."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config.schema import InferenceConfig
from asyncrl.inference.backends.native_backend import engine_metrics
from asyncrl.inference.engine.engine import Engine, GenerationRequest
from asyncrl.models.offline import init_model

TIMEOUT = 120
BLOCK = 4
PROMPT = list(range(20, 34))  # 14 tokens: three full blocks and two positions
SHARED = PROMPT[:12] + [70, 71, 72, 73, 74, 75]  # its three full blocks, then other tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix") / "tiny"
    init_model(path, "tiny", seed=0)
    return path


def start(model_dir, prefix_cache: bool, decode_ahead: bool = False, **fields) -> Engine:
    """An engine counting the positions each prefill computes; with `decode_ahead`, decoding one step ahead
    as on a GPU."""
    engine = Engine(
        InferenceConfig(
            model={"name": str(model_dir), "dtype": "float32"},
            device="cpu",
            seq_len=64,
            max_batch_size=8,
            num_threads=1,
            cuda_graphs=False,
            kv_cache_layout="paged",
            kv_block_size=BLOCK,
            prefix_cache=prefix_cache,
            **fields,
        )
    )
    computed: list[list[int]] = []  # per prefill: the positions each row computed
    prefill = engine.runner._prefill

    def counting(prompts, *args, **kwargs):
        computed.append([len(prompt) for prompt in prompts])
        return prefill(prompts, *args, **kwargs)

    engine.runner._prefill = counting
    engine.computed = computed
    engine.decode_ahead = decode_ahead
    return engine


AHEAD = pytest.mark.parametrize("decode_ahead", [False, True], ids=["step-by-step", "one-step-ahead"])


def run(engine: Engine, request: GenerationRequest):
    return engine.generate(request).result(TIMEOUT)


def assert_same(actual, expected) -> None:
    for a, b in zip(actual, expected, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5, rel=0)
        assert a.finish_reason == b.finish_reason


def perturbed(engine: Engine) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in engine.model.state_dict().items()
        if name != "lm_head.weight"  # tied to the embeddings
    }


def every_block_unheld(engine: Engine) -> bool:
    pool = engine.scheduler.blocks.pool
    return engine.stats().kv_cache_blocks_used == 0 and all(pool.refs(b) == 0 for b in range(pool.num_blocks))


FIRST = GenerationRequest(PROMPT, n=1, max_tokens=6, temperature=0.0, seed=0)
SECOND = [
    GenerationRequest(SHARED, n=1, max_tokens=10, temperature=0.0, seed=0, ignore_eos=True),
    GenerationRequest(SHARED, n=3, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True),
]


@pytest.mark.parametrize("second", SECOND, ids=["greedy", "seeded"])
def test_a_prompt_sharing_whole_blocks_with_an_ended_one_prefills_only_the_rest(model_dir, second):
    results, engines = {}, {}
    for cached in (False, True):
        engine = engines[cached] = start(model_dir, cached)
        try:
            results[cached] = run(engine, FIRST), run(engine, second)
        finally:
            engine.stop()
    for on, off in zip(results[True], results[False]):
        assert_same(on, off)
    engine = engines[True]
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == 12  # three shared whole blocks, once for the request's samples
    assert [c.cached_tokens for c in results[True][1]] == [12] * second.n
    assert [c.cached_tokens for c in results[True][0]] == [0]
    assert engine.computed == [[14], [len(SHARED) - 12]]  # only the uncached positions were computed
    assert engines[False].computed == [[14], [len(SHARED)]] and engines[False].stats().prefix_cache_hit_tokens == 0
    assert every_block_unheld(engine) and stats.prefix_cache_blocks_cached > 0
    metrics = engine_metrics(stats)
    assert "asyncrl_inference_prefix_cache_hit_tokens_total 12\n" in metrics
    assert f"asyncrl_inference_prefix_cache_blocks_cached {stats.prefix_cache_blocks_cached}\n" in metrics


def test_after_a_weight_update_the_next_request_hits_nothing(model_dir):
    second = SECOND[1]
    results = {}
    for cached in (False, True):
        engine = start(model_dir, cached)
        try:
            run(engine, FIRST)
            assert engine.update_weights(perturbed(engine), 1).result(TIMEOUT) == 1
            if cached:
                assert engine.stats().prefix_cache_blocks_cached == 0
            after = run(engine, second)
            hits_after_update = engine.stats().prefix_cache_hit_tokens
            again = run(engine, second)  # the cache fills again, under the new weights
            results[cached] = after, again
        finally:
            engine.stop()
        if cached:
            assert hits_after_update == 0 and [c.cached_tokens for c in after] == [0] * second.n
            # `after` left its prompt's 4 full blocks (and its samples' 6): the 18-token prompt again reads
            # the whole blocks before its last token, 16 positions.
            assert engine.stats().prefix_cache_hit_tokens == 16
            assert engine.computed[-1] == [len(SHARED) - 16]
            assert every_block_unheld(engine)
    for on, off in zip(results[True], results[False]):
        assert_same(on, off)
        assert {v for c in on for v in c.policy_versions} == {1}


@AHEAD
def test_a_second_turn_starts_from_the_blocks_of_the_first_turns_sample(model_dir, decode_ahead):
    prompt = list(range(40, 50))  # 10 tokens
    turn1 = GenerationRequest(prompt, n=1, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    results = {}
    for cached in (False, True):
        engine = start(model_dir, cached, decode_ahead)
        try:
            [first] = run(engine, turn1)
            turn2 = GenerationRequest(
                prompt + first.token_ids + [90, 91, 92], n=2, max_tokens=8, temperature=1.0, seed=4, ignore_eos=True
            )
            results[cached] = [first], run(engine, turn2)
        finally:
            engine.stop()
        if cached:
            # Turn 1's sample wrote 10 + 12 - 1 = 21 positions, 5 whole blocks: 20 cached tokens, not only the 8
            # of its prompt's two blocks; turn 2 computes its 25 - 20 other positions.
            assert engine.stats().prefix_cache_hit_tokens == 20
            assert [c.cached_tokens for c in results[True][1]] == [20, 20]
            assert engine.computed[-1] == [25 - 20]
            assert every_block_unheld(engine)
    assert results[True][0][0].token_ids == results[False][0][0].token_ids
    for on, off in zip(results[True], results[False]):
        assert_same(on, off)


@AHEAD
def test_preempted_samples_recomputed_from_cached_blocks_sample_the_same_tokens(model_dir, decode_ahead):
    """Blocks for little more than one sequence of seq_len: samples are preempted, register what they wrote
    and are recomputed from it (and from the prompts of others); they sample what they do with the cache
    off under the same budget."""
    budget = (64 // BLOCK + 6) * BLOCK * 512 / 2**30  # the tiny model's 512 bytes a token
    requests = [
        GenerationRequest(PROMPT, n=3, max_tokens=40, seed=1, temperature=1.0, ignore_eos=True),
        GenerationRequest(SHARED, n=2, max_tokens=45, seed=2, temperature=0.8, ignore_eos=True),
        GenerationRequest(PROMPT[:9], n=1, max_tokens=30, seed=3, ignore_eos=True),
    ]
    results, stats = {}, {}
    for cached in (False, True):
        engine = start(model_dir, cached, decode_ahead, kv_cache_gb=budget)
        try:
            futures = [engine.generate(request) for request in requests]
            results[cached] = [future.result(TIMEOUT) for future in futures]
            stats[cached] = engine.stats()
            assert every_block_unheld(engine)
        finally:
            engine.stop()
    assert stats[True].preemptions > 0 and stats[True].prefix_cache_hit_tokens > 0
    for on, off in zip(results[True], results[False]):
        assert_same(on, off)
