from pathlib import Path

import pytest

from asyncrl.config import ConfigError, RLConfig, TrainerConfig, load
from asyncrl.config.schema import SFTConfig
from asyncrl.run_setup import resolve


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_toml_layers_merge_left_to_right_and_flags_win(tmp_path):
    base = write(tmp_path / "base.toml", "max_steps = 5\n[trainer.optim]\nlr = 1e-3\nweight_decay = 0.1\n")
    over = write(tmp_path / "over.toml", "[trainer.optim]\nlr = 2e-3\n")
    cfg, _ = load(RLConfig, ["@", str(base), f"@{over}", "--trainer.optim.weight_decay", "0.5"])
    assert cfg.max_steps == 5
    assert cfg.trainer.optim.lr == 2e-3
    assert cfg.trainer.optim.weight_decay == 0.5


def test_flags_parse_booleans_lists_and_dashes():
    cfg, flags = load(
        RLConfig,
        [
            "--orchestrator.environments.reverse-text.advantage.std-normalize",
            "--trainer.optim.betas",
            "[0.8, 0.9]",
            "--dry-run",
        ],
        frozenset({"--dry-run"}),
    )
    assert cfg.orchestrator.environments["reverse_text"].advantage.std_normalize is True
    assert cfg.trainer.optim.betas == (0.8, 0.9)
    assert flags == ["--dry-run"]


def test_flag_with_equals_sign():
    cfg, _ = load(TrainerConfig, ["--optim.lr=3e-4"])
    assert cfg.optim.lr == 3e-4


def test_unknown_key_names_the_closest_valid_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.optim.lrr'; did you mean 'trainer.optim.lr'"):
        load(RLConfig, ["--trainer.optim.lrr", "1e-5"])


def test_unknown_key_in_a_file_is_rejected(tmp_path):
    path = write(tmp_path / "bad.toml", "[orchestrator]\ngroup_sise = 4\n")
    with pytest.raises(ConfigError, match="did you mean 'orchestrator.group_size'"):
        load(RLConfig, ["@", str(path)])


def test_wrong_type_names_the_dotted_path_and_value():
    with pytest.raises(ConfigError, match=r"trainer\.optim\.lr: .*'fast'"):
        load(RLConfig, ["--trainer.optim.lr", "fast"])


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load(RLConfig, ["@", str(tmp_path / "nope.toml")])


def test_shared_keys_are_copied_into_every_section():
    cfg, _ = load(RLConfig, ["--model.name", "m/x", "--seq-len", "512", "--max-steps", "7", "--output-dir", "out/a"])
    for section in (cfg.inference, cfg.orchestrator, cfg.trainer):
        assert section.model.name == "m/x"
        assert section.seq_len == 512
        assert str(section.output_dir) == "out/a"
    assert cfg.orchestrator.max_steps == cfg.trainer.max_steps == 7


def test_conflicting_shared_key_is_rejected():
    with pytest.raises(ConfigError, match="trainer.seq_len = 1024 conflicts with seq_len = 512"):
        load(RLConfig, ["--seq-len", "512", "--trainer.seq-len", "1024"])


def test_section_may_choose_its_own_dtype_but_not_its_own_model():
    cfg, _ = load(RLConfig, ["--inference.model.dtype", "bfloat16"])
    assert cfg.inference.model.dtype == "bfloat16"
    assert cfg.trainer.model.dtype == "float32"
    with pytest.raises(ConfigError, match="conflicts with model.name"):
        load(RLConfig, ["--trainer.model.name", "other"])


def test_partial_section_keeps_the_defaults_its_parent_sets():
    # sft's optim defaults (lr 2e-3, 10 warm-up steps) differ from OptimConfig's own.
    cfg, _ = load(SFTConfig, ["--optim.scheduler", "cosine"])
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.scheduler) == (2e-3, 10, "cosine")
    cfg, _ = load(SFTConfig, ["--optim.lr", "1e-4"])
    assert (cfg.optim.lr, cfg.optim.warmup_steps) == (1e-4, 10)


def test_batch_must_hold_whole_groups():
    with pytest.raises(ConfigError, match="multiple of group_size"):
        load(RLConfig, ["--orchestrator.batch-size", "10", "--orchestrator.group-size", "4"])


def test_resolve_points_orchestrator_at_inference_and_sizes_ranks():
    cfg, _ = load(RLConfig, ["--inference.port", "0", "--deployment.trainer-ranks", "2"])
    [inference], orchestrator, trainer = resolve(cfg, gpus=0)  # as on a host without a GPU
    assert inference.port > 0
    assert orchestrator.inference_urls == [f"http://127.0.0.1:{inference.port}"]
    assert orchestrator.num_trainer_ranks == 2
    assert inference.num_threads >= 1 and trainer.num_threads >= 1


def test_resolve_gives_each_replica_its_port_and_a_share_of_the_threads():
    flags = ["--inference.port", "0", "--deployment.inference-replicas", "3", "--deployment.inference-threads", "6",
             "--deployment.inference-device", "cpu", "--deployment.trainer-device", "cpu"]  # fmt: skip
    cfg, _ = load(RLConfig, flags)
    replicas, orchestrator, _ = resolve(cfg)
    assert len({r.port for r in replicas}) == 3
    assert orchestrator.inference_urls == [f"http://127.0.0.1:{r.port}" for r in replicas]
    assert [r.num_threads for r in replicas] == [2, 2, 2]
    assert {r.device for r in replicas} == {"cpu"}


def test_resolve_puts_replicas_on_consecutive_gpus_from_the_one_given():
    flags = ["--inference.port", "9000", "--deployment.inference-replicas", "2",
             "--deployment.inference-device", "cuda:2", "--deployment.trainer-device", "cuda"]  # fmt: skip
    replicas, orchestrator, trainer = resolve(load(RLConfig, flags)[0], gpus=4)
    assert [r.device for r in replicas] == ["cuda:2", "cuda:3"]
    assert [r.port for r in replicas] == [9000, 9001]
    assert trainer.device == "cuda"


def test_config_reference_in_docs_is_up_to_date():
    from asyncrl.config.reference import render

    docs = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert docs.read_text() == render(), "run: python -m asyncrl.config.reference > docs/config.md"


def test_help_lists_every_key_with_its_type_default_and_meaning(capsys):
    from asyncrl.cli import main

    main(["sft", "--help"])
    text = capsys.readouterr().out
    assert "--optim.lr float (default: 0.002)" in text  # sft's own section default, not OptimConfig's 1e-5
    assert '--model.dtype "float32" | "bfloat16" (default: float32)' in text
    assert "AdamW peak learning rate" in text
    main(["rl", "--max-steps", "3", "--help"])
    text = capsys.readouterr().out
    assert "--trainer.optim.lr float (default: 1e-05)" in text
    assert "--orchestrator.environments.<label>.weight float (default: 1.0)" in text


def test_help_of_an_unknown_command_names_it_and_fails(capsys):
    from asyncrl.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["plann", "--help"])
    assert exited.value.code == 2
    assert "unknown command 'plann'" in capsys.readouterr().err


def test_an_invalid_shared_key_is_reported_once_not_once_per_section():
    with pytest.raises(ConfigError) as error:
        load(RLConfig, ["--seq-len", "4", "--max-steps", "0", "--trainer.optim.lr", "-1"])
    assert str(error.value).splitlines()[1:] == [
        "  seq_len: Input should be greater than or equal to 8 (got 4)",
        "  max_steps: Input should be greater than or equal to 1 (got 0)",
        "  trainer.optim.lr: Input should be greater than 0 (got -1)",
    ]


def test_rl_serves_inference_on_free_ports_by_default_and_asyncrl_inference_on_8000():
    from asyncrl.config import InferenceConfig

    assert load(InferenceConfig, [])[0].port == 8000
    for flags in ([], ["--inference.max-batch-size", "4"]):  # also when the section is given in part
        cfg = load(RLConfig, [*flags, "--deployment.inference-replicas", "2", "--deployment.inference-device", "cpu",
                              "--deployment.trainer-device", "cpu"])[0]  # fmt: skip
        assert cfg.inference.port == 0
        replicas, _, _ = resolve(cfg)
        assert len({r.port for r in replicas}) == 2 and all(r.port > 0 for r in replicas)


def test_a_profile_longer_than_the_run_is_refused_and_one_that_fits_is_kept():
    with pytest.raises(ConfigError, match="max_steps = 4: the run would end before its trace is whole"):
        load(RLConfig, ["--max-steps", "4", "--trainer.profile.dir", "traces"])
    cfg, _ = load(RLConfig, ["--max-steps", "5", "--orchestrator.profile.dir", "traces"])
    assert cfg.orchestrator.profile.dir == Path("traces") and cfg.trainer.profile.dir is None


def test_the_inference_profile_is_for_the_native_engine():
    cfg, _ = load(RLConfig, ["--inference.profile.dir", "traces", "--inference.profile.active", "3"])
    assert cfg.inference.profile.dir == Path("traces") and cfg.inference.profile.active == 3
    with pytest.raises(ConfigError, match="inference.profile traces the native engine"):
        load(RLConfig, ["--inference.backend", "vllm", "--inference.profile.dir", "traces"])
