#!/usr/bin/env bash
# The tool_calc example end to end: build a small model offline, SFT-warm it, evaluate it held out, improve it
# with asynchronous RL, and evaluate again (outputs/tool_calc_eval_sft and outputs/tool_calc_eval_rl).
set -euo pipefail
cd "$(dirname "$0")/../.."
asyncrl model init --output models/tool-calc-base --preset small
asyncrl sft @ examples/tool_calc/sft.toml
asyncrl eval @ examples/tool_calc/eval.toml --model.name outputs/tool_calc_sft/final --output_dir outputs/tool_calc_eval_sft
asyncrl rl @ examples/tool_calc/rl.toml --clean
asyncrl eval @ examples/tool_calc/eval.toml --output_dir outputs/tool_calc_eval_rl
