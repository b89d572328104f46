"""The engine serves the registered mixture-of-experts families (Qwen3-MoE, GLM-4.5) on CPU: its logprobs are
transformers' teacher-forced ones and the trainer's, and new weights published in the Hugging Face layout (one
matrix per expert) go live."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config.schema import InferenceConfig, ModelConfig, PerfConfig
from asyncrl.inference.engine.engine import Engine, GenerationRequest
from asyncrl.models.checkpoint import checkpoint_state_dict
from asyncrl.models.offline import init_model
from asyncrl.trainer.logprobs import compute_logprobs
from asyncrl.trainer.model import setup_model
from asyncrl.transport.weights import publish

TIMEOUT = 60
ARCHITECTURES = ["qwen3_moe", "glm4_moe"]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model_dir(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("engine_moe") / request.param
    init_model(path, "tiny", seed=0, architecture=request.param)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = Engine(
        InferenceConfig(model={"name": str(model_dir)}, seq_len=96, max_batch_size=4, num_threads=1, device="cpu")
    )
    yield engine
    engine.stop()


def generate(engine: Engine, prompt: list[int], **fields):
    return engine.generate(GenerationRequest(prompt, **fields)).result(TIMEOUT)


def teacher_forced(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_logprobs_are_transformers_and_the_trainers(engine, model_dir):
    prompts = [[72, 105, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    completions = [generate(engine, p, n=3, temperature=0.9, max_tokens=20, seed=5, ignore_eos=True) for p in prompts]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = setup_model(ModelConfig(name=str(model_dir)), torch.device("cpu"), PerfConfig())
    for prompt, samples in zip(prompts, completions):
        for sample in samples:
            ours = torch.tensor(sample.logprobs)
            torch.testing.assert_close(
                ours, teacher_forced(reference, prompt, sample.token_ids, 0.9), atol=1e-4, rtol=0
            )
            ids = torch.tensor(prompt + sample.token_ids)
            with torch.no_grad():
                logprobs, _ = compute_logprobs(trainer, ids, torch.arange(len(ids)), temperature=0.9)
            torch.testing.assert_close(ours, logprobs[len(prompt) :], atol=1e-4, rtol=0)


def test_published_weights_in_the_checkpoint_layout_go_live(engine, model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    state = checkpoint_state_dict(model.config, model.state_dict())
    assert any(".mlp.experts.0.gate_proj.weight" in name for name in state)  # one matrix per expert, as on disk
    folder = publish(tmp_path, 1, state, model.config, AutoTokenizer.from_pretrained(model_dir))
    assert engine.update_weights(folder, 1).result(TIMEOUT) == 1
    prompt = [8, 6, 7, 5]
    [sample] = generate(engine, prompt, temperature=0.7, max_tokens=12, seed=2, ignore_eos=True)
    expected = teacher_forced(model, prompt, sample.token_ids, 0.7)
    torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
    assert set(sample.policy_versions) == {1}
