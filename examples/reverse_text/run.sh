#!/usr/bin/env bash
# The reverse-text demo: build a small model offline, SFT-warm it, then improve it with asynchronous RL.
set -euo pipefail
cd "$(dirname "$0")/../.."
asyncrl model init --output models/reverse-text-base --preset small
asyncrl sft @ examples/reverse_text/sft.toml
asyncrl rl @ examples/reverse_text/rl.toml --clean
