"""The engine in-process on a tiny model: continuous batching, KV-cache slots, logprobs, stopping, pause and
weight updates."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config.schema import InferenceConfig
from asyncrl.errors import AsyncRLError
from asyncrl.inference.engine.engine import Engine, GenerationRequest, RequestError, WeightsError
from asyncrl.inference.engine.kv_cache import GIB
from asyncrl.models.offline import init_model
from asyncrl.transport.weights import publish

TIMEOUT = 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "tiny"
    init_model(path, "tiny", seed=0)
    return path


def config(model_dir, dtype: str = "float32", **fields) -> InferenceConfig:
    model = {"name": str(model_dir), "dtype": dtype}
    fields.setdefault("device", "cpu")  # the same test on a GPU host
    return InferenceConfig(model=model, seq_len=128, max_batch_size=4, num_threads=1, **fields)


@pytest.fixture(params=[False, True], ids=["step-by-step", "one-step-ahead"])
def engine(model_dir, request):
    """Each test runs twice: as a CPU decodes (the host reads each step before the next), and one step ahead
    as a GPU decodes (the next step launched before the host reads the last)."""
    engine = Engine(config(model_dir))
    engine.decode_ahead = request.param
    yield engine
    engine.stop()


def wait_until(condition, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def run(engine: Engine, **fields) -> list:
    fields.setdefault("prompt_ids", [72, 101, 108, 108, 111])
    return engine.generate(GenerationRequest(**fields)).result(TIMEOUT)


def teacher_forced_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def perturbed_weights(model_dir, output_dir, version: int):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(version)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model, publish(
        output_dir, version, model.state_dict(), model.config, AutoTokenizer.from_pretrained(model_dir)
    )


def test_logprobs_match_teacher_forcing_before_top_k(engine, model_dir):
    prompts = [[72, 105], [1, 2, 3, 4, 5, 6, 7, 8, 9]]  # different lengths: the short one is left-padded
    futures = [
        engine.generate(GenerationRequest(p, n=2, temperature=0.8, top_k=20, max_tokens=12, seed=3)) for p in prompts
    ]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, future in zip(prompts, futures):
        for completion in future.result(TIMEOUT):
            expected = teacher_forced_logprobs(model, prompt, completion.token_ids, 0.8)
            assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


def test_llama_architecture_logprobs_match_teacher_forcing(tmp_path):
    init_model(tmp_path / "llama", "tiny", seed=1, architecture="llama")
    engine = Engine(config(tmp_path / "llama"))
    try:
        prompt = [5, 9, 2, 7]
        [completion] = run(engine, prompt_ids=prompt, max_tokens=16, temperature=1.3, seed=0)
    finally:
        engine.stop()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32)
    expected = teacher_forced_logprobs(model, prompt, completion.token_ids, 1.3)
    assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


def test_a_request_joins_the_running_batch_and_leaves_before_the_long_one(engine):
    long_request = engine.generate(GenerationRequest([3, 1, 4, 1, 5], max_tokens=100, temperature=0.0))
    wait_until(lambda: engine.generated_tokens >= 5)
    short = engine.generate(GenerationRequest([2, 7], max_tokens=3, seed=0))
    assert len(short.result(TIMEOUT)[0].token_ids) <= 3
    assert not long_request.done()  # admitted while the long one ran, not after it drained
    assert len(long_request.result(TIMEOUT)[0].token_ids) == 100


def test_samples_of_one_request_share_one_prefill(engine, monkeypatch):
    prefilled = []
    original = engine.runner.prefill

    def prefill(prompts, rows, first_slot, holders=None, **routed):
        prefilled.append((len(prompts), list(rows)))
        return original(prompts, rows, first_slot, holders, **routed)

    monkeypatch.setattr(engine.runner, "prefill", prefill)
    completions = run(engine, n=4, max_tokens=6, seed=5)
    assert prefilled == [(1, [0, 0, 0, 0])]  # one prompt row, copied to the 4 slots
    assert len({tuple(c.token_ids) for c in completions}) > 1


def test_requests_wait_for_a_free_kv_cache_slot(model_dir):
    slot_gib = 128 * 512 / GIB  # seq_len x bytes per token of the tiny model (2 layers, 1 KV head of 32, fp32)
    engine = Engine(config(model_dir, kv_cache_gb=2.5 * slot_gib))
    try:
        assert engine.stats().kv_cache_total_tokens == 2 * 128
        most_running = []
        on_token = lambda *_: most_running.append(engine.stats().running_sequences)  # noqa: E731
        engine.pause().result(TIMEOUT)
        futures = [engine.generate(GenerationRequest([1, 2, i], n=2, max_tokens=5), on_token) for i in range(3)]
        assert engine.stats().waiting_sequences == 6 and engine.stats().waiting_requests == 3
        engine.resume().result(TIMEOUT)
        assert all(len(future.result(TIMEOUT)) == 2 for future in futures)
        assert max(most_running) == 2
    finally:
        engine.stop()


def test_a_kv_cache_budget_below_one_sequence_is_refused(model_dir):
    with pytest.raises(AsyncRLError, match="kv_cache_gb"):
        Engine(config(model_dir, kv_cache_gb=1e-6))


def test_stats_count_requests_tokens_and_kv_cache_use(engine):
    engine.pause().result(TIMEOUT)
    futures = [engine.generate(GenerationRequest([1] * 10, n=2, max_tokens=5)) for _ in range(2)]
    waiting = engine.stats()
    assert (waiting.waiting_requests, waiting.waiting_sequences, waiting.running_requests) == (2, 4, 0)
    engine.resume().result(TIMEOUT)
    completions = [c for future in futures for c in future.result(TIMEOUT)]
    done = engine.stats()
    assert done.prompt_tokens == 20 and done.generated_tokens == sum(len(c.token_ids) for c in completions)
    assert done.running_sequences == done.kv_cache_used_tokens == 0 and done.kv_cache_total_tokens == 4 * 128


def test_on_token_streams_every_token_with_the_last_marked(engine):
    streamed: dict[int, list] = {0: [], 1: []}
    on_token = lambda index, *token: streamed[index].append(token)  # noqa: E731
    completions = engine.generate(GenerationRequest([4, 2], n=2, max_tokens=6, top_logprobs=2), on_token)
    for index, completion in enumerate(completions.result(TIMEOUT)):
        tokens = streamed[index]
        assert [t[0] for t in tokens] == completion.token_ids and [t[1] for t in tokens] == completion.logprobs
        assert [t[2] for t in tokens] == completion.top_logprobs and {t[3] for t in tokens} == {0}
        assert [t[4] for t in tokens] == [None] * (len(tokens) - 1) + [completion.finish_reason]


def test_min_p_one_is_greedy(engine):
    [greedy] = run(engine, max_tokens=8, temperature=0.0)
    sampled = run(engine, n=3, max_tokens=8, temperature=1.0, min_p=1.0, seed=4)
    assert all(c.token_ids == greedy.token_ids for c in sampled)


def test_bfloat16_logprobs_stay_close_to_teacher_forcing(model_dir):
    engine = Engine(config(model_dir, dtype="bfloat16"))
    try:
        prompt = [7, 3, 9]
        [completion] = run(engine, prompt_ids=prompt, max_tokens=12, seed=2)
    finally:
        engine.stop()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    expected = teacher_forced_logprobs(model, prompt, completion.token_ids, 1.0).float()
    assert (torch.tensor(completion.logprobs) - expected).abs().max() < 0.05


def test_a_sample_does_not_depend_on_its_batch_mates(engine):
    alone = run(engine, prompt_ids=[5, 6, 7], n=2, max_tokens=16, seed=9)
    engine.pause().result(TIMEOUT)
    others = engine.generate(GenerationRequest([1] * 20, n=2, max_tokens=4))
    mixed = engine.generate(GenerationRequest([5, 6, 7], n=2, max_tokens=16, seed=9))
    engine.resume().result(TIMEOUT)
    others.result(TIMEOUT)
    # The others leave after 4 tokens: the mixed samples move to their slots while a step launched ahead runs.
    mixed = mixed.result(TIMEOUT)
    assert [c.token_ids for c in mixed] == [c.token_ids for c in alone]
    for together, solo in zip(mixed, alone):
        assert torch.allclose(torch.tensor(together.logprobs), torch.tensor(solo.logprobs), atol=1e-5)


def test_seeded_samples_are_reproducible_and_distinct(engine):
    first = run(engine, n=3, max_tokens=10, seed=1)
    second = run(engine, n=3, max_tokens=10, seed=1)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert len({tuple(c.token_ids) for c in first}) == 3


def test_more_samples_than_the_batch_size_run_in_turns(engine):
    completions = run(engine, n=9, max_tokens=3, seed=0)  # max_batch_size is 4
    assert len(completions) == 9 and all(len(c.token_ids) <= 3 for c in completions)


def test_max_tokens_ends_with_length(engine):
    [completion] = run(engine, max_tokens=7, temperature=0.0)
    assert completion.finish_reason == "length"
    assert len(completion.token_ids) == len(completion.logprobs) == len(completion.policy_versions) == 7


def test_a_stop_token_ends_the_sample_and_is_kept(engine):
    [free] = run(engine, max_tokens=8, temperature=0.0)
    stop_token = free.token_ids[3]
    [stopped] = run(engine, max_tokens=8, temperature=0.0, stop_token_ids=(stop_token,))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_token) + 1]


def test_a_stop_string_ends_the_sample(engine):
    [free] = run(engine, max_tokens=24, seed=0)
    text = engine.tokenizer.decode(free.token_ids)
    stop = next(ch for ch in text[2:] if ch.isascii() and ch.isprintable())
    [stopped] = run(engine, max_tokens=24, seed=0, stop=(stop,))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert engine.tokenizer.decode(stopped.token_ids).endswith(stop)


def test_top_logprobs_are_recorded_per_token(engine):
    [completion] = run(engine, max_tokens=4, top_logprobs=3, temperature=0.5)
    assert len(completion.top_logprobs) == 4
    for chosen, top in zip(completion.logprobs, completion.top_logprobs):
        assert len(top) == 3
        assert top[0][1] >= top[1][1] >= top[2][1] and top[0][1] >= chosen


def penalized_reference(
    model, prompt: list[int], steps: int, bias: dict, repetition: float, frequency: float, presence: float
) -> tuple[list[int], list[float]]:
    """Greedy decoding with logit_bias and penalties, written out from their definitions, one full forward per
    token: what the engine must sample."""
    tokens, logprobs = [], []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].clone()
        for token, value in bias.items():
            logits[token] += value
        for token in set(prompt + tokens):
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token in set(tokens):
            logits[token] -= frequency * tokens.count(token) + presence
        chosen = int(logits.argmax())
        tokens.append(chosen)
        logprobs.append(float(torch.log_softmax(logits, dim=-1)[chosen]))
    return tokens, logprobs


def test_logit_bias_and_penalties_sample_what_their_definitions_say(engine, model_dir):
    fields = {"bias": {65: 0.5, 66: -1.0}, "repetition": 1.3, "frequency": 0.4, "presence": 0.2}
    prompt = [72, 101, 108, 108, 111]
    penalized = GenerationRequest(
        prompt,
        max_tokens=20,
        temperature=0.0,
        logit_bias=fields["bias"],
        repetition_penalty=fields["repetition"],
        frequency_penalty=fields["frequency"],
        presence_penalty=fields["presence"],
    )
    # A plain request shares the first steps and leaves: the batch is formed anew around the penalized one,
    # its counts taken from the tokens generated so far.
    futures = [engine.generate(penalized), engine.generate(GenerationRequest([9, 8, 7], max_tokens=5))]
    [completion] = futures[0].result(TIMEOUT)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens, logprobs = penalized_reference(model, prompt, 20, **fields)
    assert completion.token_ids == tokens
    assert torch.allclose(torch.tensor(completion.logprobs), torch.tensor(logprobs), atol=1e-4)
    [plain] = run(engine, prompt_ids=prompt, max_tokens=20, temperature=0.0)
    assert plain.token_ids != tokens  # the penalties changed the answer


def test_out_of_range_penalties_and_biases_are_refused(engine):
    for fields, problem in (
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {10**6: 1.0}}, "logit_bias token id 1000000"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias values"),
    ):
        with pytest.raises(RequestError, match=problem):
            engine.generate(GenerationRequest([1, 2], **fields))


def test_a_prompt_longer_than_seq_len_is_refused(engine):
    with pytest.raises(RequestError, match="seq_len"):
        engine.generate(GenerationRequest([1] * 100, max_tokens=29))
    run(engine, prompt_ids=[1] * 100, max_tokens=28)  # exactly seq_len fits


def test_nothing_decodes_while_paused(engine):
    engine.pause().result(TIMEOUT)
    future = engine.generate(GenerationRequest([1, 2], max_tokens=4))
    time.sleep(0.3)
    assert not future.done()
    assert engine.stats().waiting_sequences == 1 and engine.stats().paused
    engine.resume().result(TIMEOUT)
    assert len(future.result(TIMEOUT)[0].token_ids) >= 1


def test_a_cancelled_request_leaves_the_queue_and_the_batch_even_while_paused(engine):
    running = engine.generate(GenerationRequest([5, 6, 7], n=2, max_tokens=100, temperature=0.0))
    wait_until(lambda: engine.stats().generated_tokens >= 4)
    engine.pause().result(TIMEOUT)
    waiting = engine.generate(GenerationRequest([1, 2], n=3, max_tokens=4))
    assert engine.stats().running_sequences == 2 and engine.stats().waiting_sequences == 3
    waiting.cancel()
    running.cancel()
    wait_until(lambda: engine.stats().running_sequences == engine.stats().waiting_sequences == 0)
    assert engine.stats().kv_cache_used_tokens == 0
    engine.resume().result(TIMEOUT)
    assert run(engine, max_tokens=3)[0].token_ids  # the engine goes on serving


def test_weights_with_nan_infinite_or_integer_values_are_refused(engine):
    state = engine.model.state_dict()
    norm = state["model.norm.weight"]
    for bad, problem in (
        (torch.full_like(norm, float("nan")), "NaN or infinite"),
        (torch.full_like(norm, float("inf")), "NaN or infinite"),
        (norm.long(), "torch.int64"),
    ):
        with pytest.raises(WeightsError, match=problem):
            engine.update_weights({**state, "model.norm.weight": bad}, 1).result(TIMEOUT)
    assert engine.policy_version == 0 and torch.isfinite(engine.model.model.norm.weight).all()


def test_nan_logits_fail_the_request_with_one_clear_error_and_not_the_engine(engine):
    norm = engine.model.model.norm.weight
    saved = norm.detach().clone()
    with torch.no_grad():
        norm.fill_(float("nan"))
    with pytest.raises(AsyncRLError, match="NaN logits"):
        run(engine, max_tokens=4)
    with torch.no_grad():
        norm.copy_(saved)
    assert run(engine, max_tokens=3)[0].token_ids


def test_weights_update_mid_sequence_and_tokens_record_the_version(engine, model_dir, tmp_path):
    new_model, folder = perturbed_weights(model_dir, tmp_path, version=1)
    prompt = [3, 1, 4, 1, 5]
    future = engine.generate(GenerationRequest(prompt, max_tokens=100, temperature=0.0))
    wait_until(lambda: engine.generated_tokens >= 5)
    engine.pause().result(TIMEOUT)
    assert engine.update_weights(folder, 1).result(TIMEOUT) == 1
    engine.resume().result(TIMEOUT)
    [completion] = future.result(TIMEOUT)

    versions = completion.policy_versions
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert engine.stats().policy_version == 1
    [after] = run(engine, prompt_ids=prompt, max_tokens=10, temperature=0.7, seed=0)
    expected = teacher_forced_logprobs(new_model, prompt, after.token_ids, 0.7)
    assert torch.allclose(torch.tensor(after.logprobs), expected, atol=1e-4)
    assert set(after.policy_versions) == {1}
    embeddings = engine.model.get_input_embeddings().weight
    assert engine.model.get_output_embeddings().weight.data_ptr() == embeddings.data_ptr()  # still tied


def test_weights_update_from_an_in_memory_state_dict(engine, model_dir, tmp_path):
    new_model, _ = perturbed_weights(model_dir, tmp_path, version=2)
    state = {name: tensor for name, tensor in new_model.state_dict().items() if name != "lm_head.weight"}
    assert engine.update_weights(state, 2).result(TIMEOUT) == 2
    prompt = [8, 6, 7]
    [after] = run(engine, prompt_ids=prompt, max_tokens=10, temperature=0.9, seed=1)
    expected = teacher_forced_logprobs(new_model, prompt, after.token_ids, 0.9)
    assert torch.allclose(torch.tensor(after.logprobs), expected, atol=1e-4) and set(after.policy_versions) == {2}


def test_a_state_dict_of_another_shape_is_refused(engine):
    with pytest.raises(WeightsError, match="do not fit.*missing"):
        engine.update_weights({"model.embed_tokens.weight": torch.zeros(3, 3)}, 1).result(TIMEOUT)
    assert engine.stats().policy_version == 0


def test_a_missing_weights_folder_keeps_the_old_weights(engine, tmp_path):
    before = run(engine, max_tokens=6, temperature=0.0)
    with pytest.raises(WeightsError, match="STABLE"):
        engine.update_weights(tmp_path / "weights" / "step_7", 7).result(TIMEOUT)
    assert engine.stats().policy_version == 0
    assert run(engine, max_tokens=6, temperature=0.0)[0].token_ids == before[0].token_ids


def test_weights_of_another_shape_are_refused(engine, tmp_path):
    other_dir = tmp_path / "other"
    init_model(other_dir, "small")
    other = AutoModelForCausalLM.from_pretrained(other_dir)
    folder = publish(tmp_path, 1, other.state_dict(), other.config, AutoTokenizer.from_pretrained(other_dir))
    before = run(engine, max_tokens=6, temperature=0.0)
    with pytest.raises(WeightsError, match="do not fit"):
        engine.update_weights(folder, 1).result(TIMEOUT)
    assert run(engine, max_tokens=6, temperature=0.0)[0].token_ids == before[0].token_ids


def test_a_sampler_that_cannot_be_built_falls_back_to_torch(model_dir, monkeypatch, caplog):
    """As on a GPU whose toolchain cannot build the Triton sampler: the check at start says so in one
    warning, and the engine samples in torch instead of failing requests."""
    import asyncrl.inference.engine.engine as engine_module

    def fails_to_build(*_):
        raise RuntimeError("PTX compile failed\n(a long traceback)")

    engine = Engine(config(model_dir))
    try:
        monkeypatch.setattr(engine_module, "sample_fused", fails_to_build)
        with caplog.at_level("WARNING"):
            assert not engine._sampling_kernels_work()
        assert "Triton sampler could not be built (RuntimeError: PTX compile failed); sampling in torch" in caplog.text
        assert engine.sampling_kernels is False  # the engine is on the CPU, which never uses them
        assert len(run(engine, max_tokens=3)[0].token_ids) == 3
    finally:
        engine.stop()
