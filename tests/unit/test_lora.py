"""LoRA: only adapters train, an adapter folder holds only the adapter, and loading it gives the merged model."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from asyncrl.config.schema import LoRAConfig, ModelConfig
from asyncrl.errors import AsyncRLError
from asyncrl.loading import load_model
from asyncrl.models.offline import init_model
from asyncrl.trainer.lora import adapter_config, apply_lora, is_lora
from asyncrl.transport import weights


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "tiny"
    init_model(path, "tiny")
    return path


def lora_model(base, **lora):
    return apply_lora(load_model(ModelConfig(name=str(base)), "cpu", torch.float32), LoRAConfig(**lora))


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids[None], use_cache=False).logits[0]


IDS = torch.randint(0, 259, (16,), generator=torch.Generator().manual_seed(0))


def randomize_adapters(model):
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)


def test_only_adapters_train_and_start_as_the_base_model(base):
    model = lora_model(base, rank=4, target_modules=["q_proj", "v_proj"])
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert all(("q_proj" in name) or ("v_proj" in name) for name in trainable)
    plain = load_model(ModelConfig(name=str(base)), "cpu", torch.float32)
    torch.testing.assert_close(logits(model, IDS), logits(plain, IDS), rtol=0, atol=0)  # B = 0 at the start


def test_off_when_not_configured(base):
    model = load_model(ModelConfig(name=str(base)), "cpu", torch.float32)
    assert apply_lora(model, None) is model and not is_lora(model)


def test_published_adapter_folder_loads_as_the_merged_model(base, tmp_path):
    model = lora_model(base, rank=4, alpha=8.0)
    randomize_adapters(model)
    adapter = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    adapter = {k.replace(".default", ""): v for k, v in adapter.items()}
    folder = weights.publish_adapter(tmp_path, 3, adapter, adapter_config(model))

    assert sorted(p.name for p in folder.iterdir()) == ["STABLE", "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and config["r"] == 4
    assert weights.latest_version(tmp_path) == 3

    merged = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged.load_state_dict(weights.load_state_dict(folder), strict=False)
    expected = logits(model, IDS)
    assert (expected - logits(load_model(ModelConfig(name=str(base)), "cpu", torch.float32), IDS)).abs().max() > 0.1
    torch.testing.assert_close(logits(merged, IDS), expected, rtol=0, atol=1e-5)
    # The folder is a peft adapter folder: peft itself loads it onto the base model and agrees.
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), folder)
    torch.testing.assert_close(logits(reloaded, IDS), expected, rtol=0, atol=1e-5)


def test_merge_is_base_plus_scaled_b_times_a():
    base = {"layer.weight": torch.ones(3, 2), "other.weight": torch.zeros(1)}
    adapter = {
        "base_model.model.layer.lora_A.weight": torch.tensor([[1.0, 2.0]]),  # r = 1, in = 2
        "base_model.model.layer.lora_B.weight": torch.tensor([[1.0], [0.0], [-1.0]]),  # out = 3
    }
    merged = weights.merge_adapter(base, adapter, {"r": 1, "lora_alpha": 2.0})
    expected = torch.ones(3, 2) + 2.0 * torch.tensor([[1.0, 2.0], [0.0, 0.0], [-1.0, -2.0]])
    torch.testing.assert_close(merged["layer.weight"], expected)
    assert merged["other.weight"] is base["other.weight"]
    with pytest.raises(ValueError, match="use_dora"):
        weights.merge_adapter(base, adapter, {"r": 1, "lora_alpha": 2.0, "use_dora": True})


def test_unknown_target_module_is_one_clear_error(base):
    with pytest.raises(AsyncRLError, match=r"\['qkv'\] match no layer"):
        lora_model(base, target_modules=["qkv"])


def test_sft_with_lora_saves_the_base_model_with_the_adapter_merged(base, tmp_path):
    from asyncrl.config.schema import SFTConfig
    from asyncrl.trainer.sft import train_sft

    cfg = SFTConfig(
        model=ModelConfig(name=str(base), lora=LoRAConfig(rank=2, target_modules=["q_proj", "down_proj"])),
        output_dir=tmp_path / "sft",
        max_steps=2,
        seq_len=256,
        device="cpu",
        num_threads=1,
        log_interval=1,
        optim={"lr": 0.05, "warmup_steps": 0},
        data={"batch_size": 4},
    )
    assert train_sft(cfg) == 0
    before = load_model(ModelConfig(name=str(base)), "cpu", torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "sft" / "final", dtype=torch.float32).state_dict()
    assert sorted(after) == sorted(before)
    changed = sorted({name.split(".")[-2] for name in before if not torch.equal(before[name], after[name])})
    assert changed == ["down_proj", "q_proj"]  # only the adapted layers, each merged into its weight
