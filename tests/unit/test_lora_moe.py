"""LoRA on a mixture of experts: adapters on attention and, with `model.lora.experts`, on every routed expert;
only they train and are published, in peft's layout for the checkpoint's one module per expert, and loading
the folder gives the model the adapters make."""

from __future__ import annotations

import json

import pytest
import torch

from asyncrl.config.schema import LoRAConfig, ModelConfig, PerfConfig
from asyncrl.errors import AsyncRLError
from asyncrl.loading import load_model
from asyncrl.models.checkpoint import in_memory_state_dict
from asyncrl.models.offline import init_model
from asyncrl.trainer.distributed import close_distributed, init_distributed
from asyncrl.trainer.logprobs import compute_logprobs
from asyncrl.trainer.lora import adapter_config, adapter_state_dict, apply_lora
from asyncrl.trainer.model import setup_model
from asyncrl.transport import weights

IDS = torch.randint(0, 259, (24,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "tiny"
    init_model(path, "tiny", architecture="qwen3_moe")
    init_distributed("cpu", 1, seed=0)  # adapter_state_dict gathers, as on N ranks
    yield path
    close_distributed()


def lora_model(base, **lora):
    return setup_model(ModelConfig(name=str(base), lora=LoRAConfig(**lora)), torch.device("cpu"), PerfConfig())


def logits(model, ids=IDS):
    """The trainer's logprobs of a row (our model after `prepare_model`: document attention, chunked head)."""
    with torch.no_grad():
        return compute_logprobs(model, ids, torch.arange(len(ids)))[0]


def plain_model(base):
    return setup_model(ModelConfig(name=str(base)), torch.device("cpu"), PerfConfig())


def test_expert_adapters_train_alone_and_start_as_the_base_model(base):
    model = lora_model(base, rank=4, target_modules=["q_proj", "gate_proj", "down_proj"], experts=True)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert any("q_proj.lora_A" in name for name in trainable)
    assert {name.rsplit(".", 1)[-1] for name in trainable if ".experts." in name} == {
        "lora_gate_proj_A", "lora_gate_proj_B", "lora_down_proj_A", "lora_down_proj_B"
    }  # fmt: skip
    assert all("lora" in name for name in trainable)
    torch.testing.assert_close(logits(model), logits(plain_model(base)), rtol=0, atol=0)  # every B = 0 at first


def test_without_experts_the_routed_experts_get_no_adapter(base):
    model = lora_model(base, rank=2)
    assert not any(".experts." in name for name, p in model.named_parameters() if p.requires_grad)


def test_the_published_adapter_holds_one_module_per_expert_and_loads_as_the_adapted_model(base, tmp_path):
    model = lora_model(base, rank=4, alpha=8.0, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"],
                       experts=True)  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name or name.endswith("_B"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    adapters = adapter_state_dict(model)
    expert = "base_model.model.model.layers.1.mlp.experts.5"
    assert adapters[f"{expert}.up_proj.lora_A.weight"].shape == (4, 64)
    assert adapters[f"{expert}.up_proj.lora_B.weight"].shape == (96, 4)
    assert not any("experts.lora_" in name for name in adapters)
    folder = weights.publish_adapter(tmp_path, 1, adapters, adapter_config(model))
    assert json.loads((folder / weights.ADAPTER_CONFIG).read_text())["r"] == 4

    merged = plain_model(base)
    merged.load_state_dict(in_memory_state_dict(merged.config, weights.load_state_dict(folder)), strict=False)
    torch.testing.assert_close(logits(merged), logits(model), rtol=1e-4, atol=1e-5)
    assert (logits(merged) - logits(plain_model(base))).abs().max() > 1e-2


def test_lora_on_transformers_mixture_of_experts_is_refused(base):
    with pytest.raises(AsyncRLError, match="mixture of experts, needs model.impl = 'native'"):
        apply_lora(load_model(ModelConfig(name=str(base)), "cpu", torch.float32), LoRAConfig())


def test_expert_adapters_need_a_mixture_of_experts(tmp_path):
    init_model(tmp_path / "dense", "tiny")
    with pytest.raises(AsyncRLError, match="model.lora.experts adapts routed experts"):
        lora_model(tmp_path / "dense", experts=True)
