"""The engine in-process on a tiny model: batching, logprobs, stopping, pause and weight updates."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config.schema import InferenceConfig
from asyncrl.inference.engine import Engine, GenerationRequest, RequestError, WeightsError
from asyncrl.models import init_model
from asyncrl.transport.weights import publish

TIMEOUT = 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "tiny"
    init_model(path, "tiny", seed=0)
    return path


@pytest.fixture
def engine(model_dir):
    engine = Engine(InferenceConfig(model={"name": str(model_dir)}, seq_len=128, max_batch_size=4))
    yield engine
    engine.stop()


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


def test_a_sample_does_not_depend_on_its_batch_mates(engine):
    alone = run(engine, prompt_ids=[5, 6, 7], n=2, max_tokens=16, seed=9)
    engine.pause().result(TIMEOUT)
    others = engine.generate(GenerationRequest([1] * 20, n=2, max_tokens=4))
    mixed = engine.generate(GenerationRequest([5, 6, 7], n=2, max_tokens=16, seed=9))
    engine.resume().result(TIMEOUT)
    others.result(TIMEOUT)
    assert [c.token_ids for c in mixed.result(TIMEOUT)] == [c.token_ids for c in alone]


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


def test_weights_update_mid_sequence_and_tokens_record_the_version(engine, model_dir, tmp_path):
    new_model, folder = perturbed_weights(model_dir, tmp_path, version=1)
    prompt = [3, 1, 4, 1, 5]
    future = engine.generate(GenerationRequest(prompt, max_tokens=100, temperature=0.0))
    while engine.generated_tokens < 5:
        time.sleep(0.001)
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
