#!/usr/bin/env bash
# The wordle example end to end: build a small model offline, SFT-warm it, evaluate it held out, improve it
# with asynchronous RL, and evaluate again (outputs/wordle_eval_sft and outputs/wordle_eval_rl).
set -euo pipefail
cd "$(dirname "$0")/../.."
asyncrl model init --output models/wordle-base --preset small
asyncrl sft @ examples/wordle/sft.toml
asyncrl eval @ examples/wordle/eval.toml --model.name outputs/wordle_sft/final --output_dir outputs/wordle_eval_sft
asyncrl rl @ examples/wordle/rl.toml --clean
asyncrl eval @ examples/wordle/eval.toml --output_dir outputs/wordle_eval_rl
