"""The reverse-text example with a mixture-of-experts model learns end to end: `asyncrl model init --architecture
qwen3_moe` (8 experts, top 2), `asyncrl sft`, then `asyncrl rl` with router replay — real processes, the
native engine serving the MoE model, the trainer routing through the experts the engine recorded, published
weights in the Hugging Face layout."""

from __future__ import annotations

import statistics

import pytest
from safetensors import safe_open
from test_rl_loop import EXAMPLE, asyncrl, by_source

pytestmark = pytest.mark.integration


def test_a_mixture_of_experts_model_learns_reverse_text_with_router_replay(tmp_path):
    result = asyncrl("model", "init", "--output", str(tmp_path / "base"), "--preset", "small",
                     "--architecture", "qwen3_moe")  # fmt: skip
    assert result.returncode == 0, result.stderr
    # 200 SFT steps take this model past its loss's drop (~steps 130-170); the example runs 300.
    result = asyncrl("sft", "@", str(EXAMPLE / "sft.toml"), "@", str(EXAMPLE / "moe_sft.toml"),
                     "--model.name", str(tmp_path / "base"), "--output-dir", str(tmp_path / "sft"),
                     "--max-steps", "200", "--num-threads", "2", timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = 120
    result = asyncrl("rl", "@", str(EXAMPLE / "rl.toml"), "@", str(EXAMPLE / "moe_rl.toml"),
                     "--model.name", str(tmp_path / "sft" / "final"), "--output-dir", str(tmp_path / "rl"),
                     "--inference.port", "0", "--max-steps", str(steps), timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    orchestrator, trainer = by_source(tmp_path / "rl", "orchestrator"), by_source(tmp_path / "rl", "trainer")
    assert sorted(trainer) == list(range(1, steps + 1))
    # One run on the 2-core machine: reward 0.698 -> 0.843 (steps 1-10 -> 101-120), exact 0.131 -> 0.222.
    rewards = [orchestrator[n]["reward/mean"] for n in range(1, steps + 1)]
    first, last = statistics.fmean(rewards[:10]), statistics.fmean(rewards[-20:])
    assert last > first + 0.05, f"reward did not rise: {rewards}"
    # Where trainer and engine held the same weights, their logprobs of the same tokens agree.
    same_weights = [n for n, o in orchestrator.items() if o["off_policy/max"] == 0]
    assert same_weights and all(trainer[n]["mismatch_kl"] <= 0.01 for n in same_weights)
    assert all(1.0 <= trainer[n]["moe/load_imbalance"] <= 8.0 for n in trainer)
    assert all(trainer[n]["moe/aux_loss"] > 0.99 for n in trainer)
    # The published weights are the hub's layout: one matrix per expert.
    with safe_open(tmp_path / "rl" / "weights" / f"step_{steps}" / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert not any(name.endswith("experts.gate_up_proj") for name in names)
