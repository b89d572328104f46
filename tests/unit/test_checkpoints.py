"""Checkpoints: a part is whole or refused with its reason, resuming falls back to the newest whole one, and
the trainer's part restores model, optimizer and generators exactly (real torch.distributed.checkpoint)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from asyncrl import checkpoints
from asyncrl.config.schema import ModelConfig, OptimConfig, PerfConfig
from asyncrl.environments.reverse_text import ReverseText
from asyncrl.errors import AsyncRLError
from asyncrl.models.offline import init_model
from asyncrl.orchestrator import checkpoint as orchestrator_checkpoint
from asyncrl.orchestrator.sampler import EnvironmentSampler
from asyncrl.output_dir import resume_run
from asyncrl.trainer import checkpoint as trainer_checkpoint
from asyncrl.trainer.distributed import close_distributed, init_distributed
from asyncrl.trainer.logprobs import compute_logprobs
from asyncrl.trainer.model import make_optimizer, parallelize, setup_model


def write_part(output_dir: Path, step: int, part: str, payload: bytes = b"weights") -> Path:
    staging = checkpoints.begin_part(output_dir, step, part)
    (staging / "data.bin").write_bytes(payload)
    return checkpoints.finish_part(output_dir, step, part)


def write_checkpoint(output_dir: Path, step: int) -> None:
    for part in checkpoints.RL_PARTS:
        write_part(output_dir, step, part)


def test_a_finished_part_has_a_manifest_and_passes(tmp_path):
    path = write_part(tmp_path, 3, "trainer")
    assert path == tmp_path / "checkpoints" / "step_3" / "trainer"
    assert json.loads((path / checkpoints.MANIFEST).read_text())["files"]["data.bin"]["bytes"] == len(b"weights")
    assert checkpoints.part_problem(path) is None


def test_a_half_written_part_is_refused(tmp_path):
    staging = checkpoints.begin_part(tmp_path, 3, "trainer")
    (staging / "data.bin").write_bytes(b"wei")
    problem = checkpoints.part_problem(checkpoints.part_dir(tmp_path, 3, "trainer"))
    assert "stopped before finishing" in problem


def test_a_part_without_its_manifest_is_refused(tmp_path):
    path = write_part(tmp_path, 3, "trainer")
    (path / checkpoints.MANIFEST).unlink()
    assert "no readable MANIFEST.json" in checkpoints.part_problem(path)


def test_a_truncated_file_is_refused(tmp_path):
    path = write_part(tmp_path, 3, "trainer")
    (path / "data.bin").write_bytes(b"weig")
    assert "has 4 bytes, the manifest says 7 (corrupted)" in checkpoints.part_problem(path)


def test_a_changed_byte_is_refused(tmp_path):
    path = write_part(tmp_path, 3, "trainer")
    (path / "data.bin").write_bytes(b"weightz")
    assert "SHA-256" in checkpoints.part_problem(path)


def test_resume_takes_the_newest_whole_checkpoint_and_says_why_it_passed_newer_ones(tmp_path):
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step)
    (checkpoints.part_dir(tmp_path, 6, "trainer") / "data.bin").write_bytes(b"garbage")
    write_part(tmp_path, 8, "orchestrator")  # the trainer never finished step 8
    step, refused = checkpoints.find_resume_step(tmp_path, checkpoints.RL_PARTS, None)
    assert step == 4
    assert [line.split(":")[0] for line in refused] == ["checkpoint step 8 refused", "checkpoint step 6 refused"]
    assert "step_6/trainer/data.bin" in refused[1] and "corrupted" in refused[1]


def test_resuming_a_named_broken_checkpoint_is_one_clear_error(tmp_path):
    write_checkpoint(tmp_path, 2)
    write_part(tmp_path, 4, "trainer")
    with pytest.raises(AsyncRLError, match=r"cannot resume from checkpoint step 4: .*step_4/orchestrator is missing"):
        checkpoints.find_resume_step(tmp_path, checkpoints.RL_PARTS, 4)
    assert checkpoints.find_resume_step(tmp_path, checkpoints.RL_PARTS, 2) == (2, [])
    assert checkpoints.find_resume_step(tmp_path, checkpoints.SFT_PARTS, 4) == (4, [])


def test_resuming_without_checkpoints_says_how_to_get_them(tmp_path):
    with pytest.raises(AsyncRLError, match="no complete checkpoint .* ckpt.interval"):
        checkpoints.find_resume_step(tmp_path, checkpoints.RL_PARTS, None)


def test_launcher_resume_rewinds_to_the_checkpoint_and_refuses_what_cannot_go_on(tmp_path):
    write_checkpoint(tmp_path, 2)
    write_part(tmp_path, 4, "trainer")
    with pytest.raises(AsyncRLError, match="--resume continues the run in output_dir and --clean deletes it"):
        resume_run(tmp_path, None, max_steps=6, clean=True)
    with pytest.raises(AsyncRLError, match="already at max_steps"):
        resume_run(tmp_path, None, max_steps=2, clean=False)
    with pytest.raises(AsyncRLError, match="cannot resume from checkpoint step 4: .*orchestrator is missing"):
        resume_run(tmp_path, 4, max_steps=6, clean=False)
    assert resume_run(tmp_path, None, max_steps=6, clean=False) == 2
    assert checkpoints.saved_steps(tmp_path) == [2]


def test_prune_keeps_the_newest_whole_checkpoints_and_anything_newer(tmp_path):
    for step in (2, 4, 6, 8):
        write_checkpoint(tmp_path, step)
    write_part(tmp_path, 10, "orchestrator")  # being written
    checkpoints.prune(tmp_path, checkpoints.RL_PARTS, keep_last=2)
    assert checkpoints.saved_steps(tmp_path) == [6, 8, 10]


def test_rewind_deletes_what_came_after_the_step(tmp_path):
    for folder in ("weights", "rollouts", "checkpoints"):
        for step in (2, 3):
            (tmp_path / folder / f"step_{step}").mkdir(parents=True)
    (tmp_path / "weights" / ".step_4.tmp").mkdir()
    lines = [{"step": s, "source": src} for s in (1, 2, 3) for src in ("trainer", "orchestrator")]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    checkpoints.rewind(tmp_path, 2)
    for folder in ("weights", "rollouts", "checkpoints"):
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == ["step_2"]
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == lines[:4]


def test_rewind_drops_a_line_cut_off_mid_write(tmp_path):
    """A writer killed (or stopped by a full disk) in the middle of its line leaves it cut short."""
    whole = json.dumps({"step": 1, "source": "trainer", "loss": 0.5}) + "\n"
    (tmp_path / "metrics.jsonl").write_text(whole + '{"step": 2, "source": "trai')
    checkpoints.rewind(tmp_path, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == whole


def sampler() -> EnvironmentSampler:
    return EnvironmentSampler({"reverse_text": ReverseText()}, {"reverse_text": 1.0}, seed=5)


def test_orchestrator_resume_restores_the_sampler_to_draw_what_comes_next(tmp_path):
    saved = sampler()
    saved.draw(7)
    progress = orchestrator_checkpoint.OrchestratorProgress(step=2, policy_version=1, sampler=saved.state_dict())
    orchestrator_checkpoint.save(tmp_path, progress, [])
    write_part(tmp_path, 2, "trainer")
    restored = sampler()
    assert orchestrator_checkpoint.resume(tmp_path, None, restored) == progress
    assert restored.draw(3) == saved.draw(3)


def test_orchestrator_resume_with_other_environments_is_one_clear_error(tmp_path):
    state = {"drawn": {"arithmetic": 4}}
    orchestrator_checkpoint.save(tmp_path, orchestrator_checkpoint.OrchestratorProgress(2, 1, state), [])
    write_part(tmp_path, 2, "trainer")
    with pytest.raises(AsyncRLError, match="does not fit this run: saved environments"):
        orchestrator_checkpoint.resume(tmp_path, None, sampler())


def test_group_seeds_depend_on_the_run_seed_and_the_group_number_only():
    seeds = {orchestrator_checkpoint.group_seed(s, g) for s in (0, 1) for g in range(4)}
    assert len(seeds) == 8
    assert orchestrator_checkpoint.group_seed(1, 3) == orchestrator_checkpoint.group_seed(1, 3)


@pytest.fixture
def world():
    world = init_distributed("cpu", 1, seed=0)
    yield world
    close_distributed()


def train_one_step(model, optimizer) -> float:
    input_ids = torch.arange(3, 40)
    logprobs, _ = compute_logprobs(model, input_ids, torch.arange(len(input_ids)))
    loss = -logprobs.mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


@pytest.mark.parametrize("fsdp_unit", ["model", "layer"])
def test_trainer_checkpoint_restores_model_optimizer_and_generators_exactly(tmp_path, world, fsdp_unit):
    init_model(tmp_path / "model", "tiny")
    model_cfg, optim_cfg = ModelConfig(name=str(tmp_path / "model")), OptimConfig(lr=1e-2, weight_decay=0.1)
    perf = PerfConfig(fsdp_unit=fsdp_unit)

    def fresh():
        model = parallelize(setup_model(model_cfg, world.device, perf), 1, world.device, "float32", perf)
        return model, make_optimizer(model, optim_cfg)

    model, optimizer = fresh()
    for _ in range(2):
        train_one_step(model, optimizer)
    random.seed(123)
    torch.manual_seed(123)
    trainer_checkpoint.save(tmp_path / "run", trainer_checkpoint.TrainerProgress(2, 640), model, optimizer, world)
    write_part(tmp_path / "run", 2, "orchestrator")
    expected_draws = (random.random(), torch.rand(3))
    expected_loss = train_one_step(model, optimizer)  # the uninterrupted run's step 3

    resumed_model, resumed_optimizer = fresh()
    progress = trainer_checkpoint.resume(
        tmp_path / "run", checkpoints.RL_PARTS, None, resumed_model, resumed_optimizer, world
    )
    assert progress == trainer_checkpoint.TrainerProgress(step=2, examples_drawn=640)
    assert random.random() == expected_draws[0] and torch.equal(torch.rand(3), expected_draws[1])
    assert train_one_step(resumed_model, resumed_optimizer) == expected_loss
    for (name, a), b in zip(model.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
