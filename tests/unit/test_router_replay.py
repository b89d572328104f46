"""Router replay: the engine records the experts it routed every token to; the trainer, given them, routes
the same tokens the same way — which changes nothing when the two already agree, and makes the trainer follow
the recorded experts when they do not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.config.schema import InferenceConfig, ModelConfig, PerfConfig
from asyncrl.environments.base import Completion, TokenSample
from asyncrl.inference.api.token_routes import generate_answer
from asyncrl.inference.engine.engine import Engine, GenerationRequest
from asyncrl.models.offline import init_model
from asyncrl.orchestrator.packing import Sample, to_micro_batch
from asyncrl.trainer.logprobs import row_logprobs
from asyncrl.trainer.model import setup_model
from asyncrl.transport import routing

TIMEOUT = 60


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe"])
def model_dir(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("replay") / request.param
    init_model(path, "tiny", seed=4, architecture=request.param)
    return path


@pytest.fixture(scope="module")
def sample(model_dir):
    """A prompt, the engine's samples of it and their routing."""
    engine = Engine(
        InferenceConfig(model={"name": str(model_dir)}, seq_len=96, max_batch_size=4, num_threads=1, device="cpu")
    )
    try:
        prompt = [5, 17, 99, 3, 44, 8]
        request = GenerationRequest(prompt, n=2, max_tokens=16, seed=1, ignore_eos=True, return_routed_experts=True)
        return prompt, engine.generate(request).result(TIMEOUT)
    finally:
        engine.stop()


def trainer_model(model_dir):
    return setup_model(ModelConfig(name=str(model_dir)), torch.device("cpu"), PerfConfig())


def routed_by(model, ids: list[int], replay: torch.Tensor | None = None):
    """The trainer's logprobs of a row and the experts each of its MoE layers chose, [T, layers, k]."""
    chosen = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out: chosen.append(out.indices))
        for layer in model.model.layers
        if layer.is_moe
    ]
    try:
        with torch.no_grad():
            row = row_logprobs(model, torch.tensor(ids), torch.arange(len(ids)), routed_experts=replay)
    finally:
        for hook in hooks:
            hook.remove()
    return row.logprobs, torch.stack(chosen, dim=1)


def test_the_engine_records_the_experts_the_trainer_routes_to(sample, model_dir):
    prompt, completions = sample
    model = trainer_model(model_dir)
    for completion in completions:
        ids = prompt + completion.token_ids
        recorded = np.concatenate([completion.prompt_routed_experts, completion.routed_experts])
        assert recorded.shape == (len(ids), len(model.moe_layers), 2)
        assert (recorded[-1] == routing.NOT_RECORDED).all()  # the last token was never fed through the model
        _, chosen = routed_by(model, ids)
        assert torch.equal(torch.from_numpy(recorded[:-1]).long(), chosen[:-1])


def test_replaying_agreeing_routes_changes_nothing(sample, model_dir):
    prompt, [completion, _] = sample
    model = trainer_model(model_dir)
    ids = prompt + completion.token_ids
    recorded = torch.from_numpy(np.concatenate([completion.prompt_routed_experts, completion.routed_experts]))
    plain, _ = routed_by(model, ids)
    replayed, _ = routed_by(model, ids, recorded)
    torch.testing.assert_close(replayed, plain, atol=1e-6, rtol=0)


def test_replay_makes_the_trainer_follow_the_recorded_experts(sample, model_dir):
    prompt, [completion, _] = sample
    model = trainer_model(model_dir)
    ids = prompt + completion.token_ids
    _, own = routed_by(model, ids)
    # Other experts for every token: its own choice shifted by one (mod E), distinct within the token.
    other = (own + 1) % 8
    other[3] = routing.NOT_RECORDED  # a token without a record routes as it would
    plain, _ = routed_by(model, ids)
    replayed, followed = routed_by(model, ids, other)
    assert torch.equal(followed[torch.arange(len(ids)) != 3], other[torch.arange(len(ids)) != 3])
    assert torch.equal(followed[3], own[3])
    assert (replayed - plain).abs().max() > 1e-3


def test_routing_travels_from_the_answer_to_the_trainers_row(sample):
    """/v1/generate's answer → the orchestrator's token sample → a packed row's routed_experts stream."""
    prompt, completions = sample
    answer = generate_answer(completions, len(prompt))
    choice = answer["choices"][0]
    completion = Completion(
        choice["token_ids"],
        choice["logprobs"],
        choice["policy_versions"],
        choice["finish_reason"],
        routing.decode(answer["prompt_routed_experts"]),
        routing.decode(choice["routed_experts"]),
    )
    token_sample = TokenSample(list(prompt), [False] * len(prompt), [0.0] * len(prompt))
    token_sample.extend(completion.token_ids, completion.logprobs)
    token_sample.record_routing(completion)
    token_sample.extend([7, 7])  # an environment's answer: routed later, if ever
    plain = Sample([1, 2, 3], [False, True, True], 0.5, [0.0, -1.0, -1.0], 1.0)
    routed = Sample(token_sample.input_ids, token_sample.loss_mask, 1.0, token_sample.inference_logprobs, 1.0,
                    token_sample.routed_experts)  # fmt: skip
    row = to_micro_batch([routed, plain])
    expected = np.concatenate([completions[0].prompt_routed_experts, completions[0].routed_experts])
    assert torch.equal(row.routed_experts[: len(expected)], torch.from_numpy(expected))
    assert (row.routed_experts[len(expected) :] == routing.NOT_RECORDED).all()
    assert row.routed_experts.shape[0] == row.input_ids.shape[0]
