"""The filesystem publisher writes each version in the serving dtype and the run's last one in full precision, in
a background thread: the trainer goes on meanwhile, and what is written is the policy it published."""

import errno
import threading

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from asyncrl.config.schema import ModelConfig, PerfConfig, TrainerConfig, WeightTransferConfig
from asyncrl.loading import load_tokenizer
from asyncrl.models.offline import init_model
from asyncrl.trainer.distributed import close_distributed, init_distributed
from asyncrl.trainer.model import full_state_dict, parallelize, setup_model
from asyncrl.trainer.rl import publish_weights
from asyncrl.transport import weights
from asyncrl.transport.transfer import make_publisher


def dtypes_written(folder) -> set[torch.dtype]:
    with safe_open(folder / weights.WEIGHTS_FILE, framework="pt") as f:
        return {f.get_tensor(name).dtype for name in f.keys()}


def test_versions_are_written_in_the_serving_dtype_and_the_last_in_full_precision(tmp_path):
    init_model(tmp_path / "model", preset="tiny")
    config, tokenizer = AutoConfig.from_pretrained(tmp_path / "model"), load_tokenizer(str(tmp_path / "model"))
    master = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}
    publisher = make_publisher(WeightTransferConfig(), tmp_path / "run", torch.device("cpu"), torch.bfloat16, True)

    publisher.publish(1, master, config, tokenizer, None, last=False)
    publisher.publish(2, master, config, tokenizer, None, last=True)
    publisher.wait()

    step_1, step_2 = weights.weights_dir(tmp_path / "run", 1), weights.weights_dir(tmp_path / "run", 2)
    assert (step_1 / weights.MARKER).exists() and (step_2 / weights.MARKER).exists()
    assert dtypes_written(step_1) == {torch.bfloat16}
    assert dtypes_written(step_2) == {torch.float32}
    assert master["model.embed_tokens.weight"].dtype == torch.float32  # the trainer's tensors are not touched


@pytest.fixture
def world():
    world = init_distributed("cpu", 1, seed=0)
    yield world
    close_distributed()


@pytest.fixture
def held_writes(monkeypatch):
    """Folder writes wait until the test sets the event, as a slow disk would hold them."""
    release, write = threading.Event(), weights.publish

    def held(*args, **kwargs):
        assert release.wait(30)
        return write(*args, **kwargs)

    monkeypatch.setattr(weights, "publish", held)
    return release


@pytest.mark.parametrize("fsdp_unit", ["model", "layer"])
def test_the_trainer_goes_on_while_a_version_is_written_and_the_version_is_the_published_policy(
    tmp_path, world, held_writes, fsdp_unit
):
    init_model(tmp_path / "model", preset="tiny")
    cfg = TrainerConfig(model=ModelConfig(name=str(tmp_path / "model")), output_dir=tmp_path / "run", max_steps=10)
    perf = PerfConfig(fsdp_unit=fsdp_unit)
    model = parallelize(setup_model(cfg.model, world.device, perf), 1, world.device, "float32", perf)
    tokenizer = load_tokenizer(cfg.model.name)
    publisher = make_publisher(cfg.weight_transfer, cfg.output_dir, world.device, torch.float32, True)
    published = {k: v.clone() for k, v in full_state_dict(model).items()}

    publish_weights(model, tokenizer, cfg, 1, world, publisher)  # returns with the write still held
    assert not (weights.weights_dir(cfg.output_dir, 1) / weights.MARKER).exists()
    with torch.no_grad():  # the next optimizer step, in place, on one CPU rank where the state dict shares memory
        for parameter in model.parameters():
            parameter.add_(1.0)
    held_writes.set()
    publisher.wait()

    written = weights.load_state_dict(weights.weights_dir(cfg.output_dir, 1))
    assert (weights.weights_dir(cfg.output_dir, 1) / weights.MARKER).exists()
    assert all(torch.equal(written[k], published[k]) for k in written)


def test_a_failed_write_is_raised_in_the_trainer_and_old_versions_are_pruned_after_each_write(tmp_path, monkeypatch):
    init_model(tmp_path / "model", preset="tiny")
    config, tokenizer = AutoConfig.from_pretrained(tmp_path / "model"), load_tokenizer(str(tmp_path / "model"))
    state = {"model.norm.weight": torch.ones(4)}
    publisher = make_publisher(WeightTransferConfig(), tmp_path / "run", torch.device("cpu"), torch.float32, True, 2)
    for version in range(1, 5):
        publisher.publish(version, state, config, tokenizer, None, last=False)
    publisher.wait()
    assert sorted(p.name for p in (tmp_path / "run" / "weights").iterdir()) == ["step_3", "step_4"]

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "weights"))

    monkeypatch.setattr(weights, "publish", full_disk)
    publisher.publish(5, state, config, tokenizer, None, last=False)  # handed over; the write fails meanwhile
    with pytest.raises(OSError, match="No space left"):
        publisher.publish(6, state, config, tokenizer, None, last=False)
    publisher.wait()  # the failure was raised once
