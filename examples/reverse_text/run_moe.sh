#!/usr/bin/env bash
# The reverse-text demo with a mixture-of-experts model (Qwen3-MoE architecture, 8 experts, top 2): build it
# offline, SFT-warm it, evaluate, improve it with asynchronous RL (router replay on), evaluate again.
set -euo pipefail
cd "$(dirname "$0")/../.."
asyncrl model init --output models/reverse-text-moe-base --preset small --architecture qwen3_moe
asyncrl sft @ examples/reverse_text/sft.toml @ examples/reverse_text/moe_sft.toml
asyncrl eval @ examples/reverse_text/eval.toml --model.name outputs/reverse_text_moe_sft/final \
    --output-dir outputs/reverse_text_moe_eval_sft
asyncrl rl @ examples/reverse_text/rl.toml @ examples/reverse_text/moe_rl.toml --clean
asyncrl eval @ examples/reverse_text/eval.toml --model.name outputs/reverse_text_moe_rl/weights/step_250 \
    --output-dir outputs/reverse_text_moe_eval_rl
