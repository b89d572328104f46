"""What `asyncrl rl` checks before it starts anything: each mistake is one line naming it and the fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from asyncrl import preflight
from asyncrl.config import InferenceConfig, OrchestratorConfig, TrainerConfig
from asyncrl.environments import Example, load_environment
from asyncrl.errors import AsyncRLError
from asyncrl.loading import check_model, load_tokenizer
from asyncrl.models.offline import init_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny"
    init_model(path, "tiny")
    return path


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_an_output_dir_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(AsyncRLError) as error:
        preflight.check_output_dir(tmp_path / "file" / "run")
    assert one_line(error) == (
        f"output_dir '{tmp_path / 'file' / 'run'}' cannot be created: Not a directory (set output_dir to a folder "
        "you can write)"
    )


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc")
def test_an_output_dir_under_proc_is_refused():
    with pytest.raises(AsyncRLError, match="output_dir '/proc/asyncrl-run' cannot be created"):
        preflight.check_output_dir(Path("/proc/asyncrl-run"))


def test_a_model_folder_without_config_json_is_refused(tmp_path):
    with pytest.raises(AsyncRLError) as error:
        check_model(str(tmp_path))
    assert "has no config.json" in one_line(error) and "hub id" not in one_line(error)


def test_a_model_folder_with_a_broken_config_json_is_refused(tiny_model, tmp_path):
    broken = shutil.copytree(tiny_model, tmp_path / "broken")
    (broken / "config.json").write_text('{"model_type": "qwen3",')
    with pytest.raises(AsyncRLError) as error:
        check_model(str(broken))
    assert one_line(error).startswith(f"model folder '{broken}': config.json is not valid JSON")


def test_a_model_folder_without_weights_is_refused(tiny_model, tmp_path):
    partial = shutil.copytree(tiny_model, tmp_path / "partial")
    (partial / "model.safetensors").unlink()
    with pytest.raises(AsyncRLError, match="holds no weights"):
        check_model(str(partial))


def test_a_model_folder_that_transformers_cannot_read_needs_no_hub_hint(tiny_model, tmp_path):
    unknown = shutil.copytree(tiny_model, tmp_path / "unknown")
    (unknown / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(AsyncRLError) as error:
        check_model(str(unknown))
    assert one_line(error).startswith(f"model folder '{unknown}' could not be loaded")
    assert "hub id" not in one_line(error)


def test_a_whole_model_folder_passes_and_gives_its_tokenizer(tiny_model):
    assert check_model(str(tiny_model)).eos_token is not None


def test_an_environment_module_that_raises_on_import_names_its_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "broken_env.py").write_text("import math\n\nLIMIT = math.sqrt(-1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AsyncRLError) as error:
        load_environment("broken_env:Task")
    assert one_line(error) == (
        f"environment 'broken_env:Task' could not be imported: its module raised at {tmp_path / 'broken_env.py'}:3: "
        "ValueError: math domain error"
    )


def test_an_unknown_environment_name_is_refused():
    with pytest.raises(AsyncRLError, match="unknown environment 'reverse_txt'"):
        preflight.local_environments(OrchestratorConfig(environments={"reverse_txt": {}}))


def test_an_unknown_online_eval_environment_is_refused_before_start():
    cfg = OrchestratorConfig(eval={"interval": 5, "environments": {"held_out": {"name": "reverse_txt"}}})
    with pytest.raises(AsyncRLError, match="unknown environment 'reverse_txt'"):
        preflight.online_eval_environments(cfg)
    assert (
        preflight.online_eval_environments(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"interval": 0})}))
        == {}
    )


def test_an_eval_entry_labelled_as_a_training_environment_is_that_environment():
    from asyncrl.evals.online import online_eval_environments

    training = {"letters": {"name": "reverse_text", "args": {"min_length": 3, "max_length": 5}}}
    cfg = OrchestratorConfig(
        environments=training, eval={"environments": {"letters": {"num_examples": 64, "args": {"max_length": 9}}}}
    )
    entry = online_eval_environments(cfg)["letters"]
    assert (entry.name, entry.args, entry.num_examples) == ("reverse_text", {"min_length": 3, "max_length": 9}, 64)
    assert online_eval_environments(OrchestratorConfig(environments=training))["letters"].name == "reverse_text"


def lengths(tiny_model: Path, **fields) -> list[str]:
    cfg = OrchestratorConfig(**fields)
    environments = preflight.local_environments(cfg)
    return preflight.check_prompt_lengths(environments, load_tokenizer(str(tiny_model)), cfg)


def test_prompts_that_leave_no_room_for_an_answer_fail_before_the_run(tiny_model):
    """reverse_text's prompts of 4-12 letters are 23-31 tokens in the byte-level chat template."""
    with pytest.raises(AsyncRLError) as error:
        lengths(tiny_model, seq_len=16)
    assert one_line(error) == (
        "the first 64 prompts of environment 'reverse_text' are 23-31 tokens: none leaves room for an answer "
        "within seq_len = 16, so the run would train nothing (raise seq_len to at least 95)"
    )


def test_some_prompts_too_long_or_answers_cut_short_are_warnings(tiny_model):
    warnings = lengths(tiny_model, seq_len=28, sampling={"max_tokens": 8})
    assert len(warnings) == 2
    assert "leave no room for an answer within seq_len = 28; their rollouts are cut" in warnings[0]
    assert "are cut at seq_len = 28 before sampling.max_tokens = 8" in warnings[1]


def test_max_tokens_longer_than_seq_len_is_a_warning(tiny_model):
    [warning, _] = lengths(tiny_model, seq_len=64, sampling={"max_tokens": 100})
    assert warning.startswith("orchestrator.sampling.max_tokens = 100 exceeds seq_len = 64")


def test_prompts_that_fit_give_no_warning(tiny_model):
    assert lengths(tiny_model, seq_len=128, sampling={"max_tokens": 64}) == []


def test_an_environment_that_builds_its_own_prompts_is_not_measured(tiny_model):
    """Its examples carry no chat messages (the pipeline benchmark's long-tail workload sends token ids)."""

    class TokenPrompts(load_environment("reverse_text").__class__):
        def examples(self, seed):
            while True:
                yield Example([], "", {"prompt_ids": [1, 2, 3]})

    cfg = OrchestratorConfig(seq_len=16, sampling={"max_tokens": 8})
    assert preflight.check_prompt_lengths({"tokens": TokenPrompts()}, load_tokenizer(str(tiny_model)), cfg) == []


def test_more_cpu_processes_than_cores_is_a_warning_naming_them():
    servers = [InferenceConfig(device="cpu")]
    warning = preflight.cpu_oversubscription(servers, TrainerConfig(device="cpu"), 8, cores=2)
    assert "8 trainer rank(s) and 1 inference server(s) compute on the CPU, which has 2 usable core(s)" in warning
    assert preflight.cpu_oversubscription(servers, TrainerConfig(device="cpu"), 1, cores=2) is None
    assert preflight.cpu_oversubscription(servers, TrainerConfig(device="cuda"), 8, cores=2) is None
