# One command each: `make demo` (set up, then build, SFT-warm and RL-train a tiny model on CPU)
# and `make test` (set up, then run the test suite). Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch to install when .venv has none. On our machines this is the CPU build; elsewhere PyPI serves the
# CUDA build: for a small CPU-only install use TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu".
TORCH ?= torch==2.13.0

.PHONY: setup demo test test-gpu test-slurm

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

demo: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" bash examples/reverse_text/run.sh

test: setup
	$(BIN)/python -m pytest -q

# On a GPU host: the whole suite with its GPU tests (the Triton kernels compiled, not interpreted; CUDA paths),
# in a venv that keeps the host's CUDA build of torch.
test-gpu:
	$(PYTHON) -c "import sys, torch; sys.exit(None if torch.cuda.is_available() else 'test-gpu: torch sees no CUDA GPU here')"
	$(PYTHON) -m venv --system-site-packages .venv-gpu
	.venv-gpu/bin/pip install -q -e ".[dev]"
	.venv-gpu/bin/python -m pytest -q

# `asyncrl slurm` against a real Slurm (opt-in; needs the distribution's slurm-wlm, see docs/clusters.md)
test-slurm: setup
	$(BIN)/python -m pytest -q -m slurm tests/integration/test_slurm.py
