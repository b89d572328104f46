#!/usr/bin/env bash
# The code example end to end: build a small model offline, SFT-warm it, evaluate it held out, improve it
# with asynchronous RL, and evaluate again (outputs/code_eval_sft and outputs/code_eval_rl).
set -euo pipefail
cd "$(dirname "$0")/../.."
asyncrl model init --output models/code-base --preset small
asyncrl sft @ examples/code/sft.toml
asyncrl eval @ examples/code/eval.toml --model.name outputs/code_sft/final --output_dir outputs/code_eval_sft
asyncrl rl @ examples/code/rl.toml --clean
asyncrl eval @ examples/code/eval.toml --output_dir outputs/code_eval_rl
