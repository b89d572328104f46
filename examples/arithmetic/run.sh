#!/usr/bin/env bash
# The arithmetic example end to end: build a small model offline, SFT-warm it, evaluate it held out, improve it
# with asynchronous RL, and evaluate again (outputs/arithmetic_eval_sft and outputs/arithmetic_eval_rl).
set -euo pipefail
cd "$(dirname "$0")/../.."
asyncrl model init --output models/arithmetic-base --preset small
asyncrl sft @ examples/arithmetic/sft.toml
asyncrl eval @ examples/arithmetic/eval.toml --model.name outputs/arithmetic_sft/final --output_dir outputs/arithmetic_eval_sft
asyncrl rl @ examples/arithmetic/rl.toml --clean
asyncrl eval @ examples/arithmetic/eval.toml --output_dir outputs/arithmetic_eval_rl
