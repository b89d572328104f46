"""Every example's configs load: a renamed key or a bad value in examples/ fails here, not in a user's run."""

from pathlib import Path

import pytest

from asyncrl.config.loader import load
from asyncrl.config.schema import EvalConfig, RLConfig, SFTConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
KINDS = {"sft.toml": SFTConfig, "rl.toml": RLConfig, "eval.toml": EvalConfig}
CONFIGS = sorted(path for name in KINDS for path in EXAMPLES.glob(f"*/{name}"))


def test_every_task_example_has_its_configs_and_run_script():
    for task in ("arithmetic", "code", "reverse_text", "tool_calc", "wordle"):
        for name in (*KINDS, "run.sh"):
            assert (EXAMPLES / task / name).is_file(), f"examples/{task}/{name} is missing"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_the_example_config_loads(path):
    config, _ = load(KINDS[path.name], ["@", str(path)])
    assert config is not None


@pytest.mark.parametrize("task", ["arithmetic", "code", "tool_calc", "wordle"])
def test_rl_examples_share_one_setting_and_start_from_their_sft_model(task):
    rl, _ = load(RLConfig, ["@", str(EXAMPLES / task / "rl.toml")])
    sft, _ = load(SFTConfig, ["@", str(EXAMPLES / task / "sft.toml")])
    assert rl.trainer.optim.lr == 1e-4
    assert rl.orchestrator.group_size == 8
    assert all(env.advantage.estimator == "grpo" and not env.advantage.std_normalize
               for env in rl.orchestrator.environments.values())  # fmt: skip
    assert Path(rl.model.name) == sft.output_dir / "final"


def test_the_mixture_of_experts_reverse_text_layers_load_and_chain():
    """run_moe.sh's layering: its SFT writes the model its RL starts from, with router replay on."""
    folder = EXAMPLES / "reverse_text"
    sft, _ = load(SFTConfig, ["@", str(folder / "sft.toml"), "@", str(folder / "moe_sft.toml")])
    rl, _ = load(RLConfig, ["@", str(folder / "rl.toml"), "@", str(folder / "moe_rl.toml")])
    assert Path(rl.model.name) == sft.output_dir / "final"
    assert rl.trainer.loss.router_replay and rl.orchestrator.router_replay
    assert (folder / "run_moe.sh").is_file()
