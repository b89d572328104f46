# One command each: `make demo` (set up, then build, SFT-warm and RL-train a tiny model on CPU)
# and `make test` (set up, then run the test suite). Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a GPU machine install the CUDA build of your choice first, then `make setup`.
TORCH ?= torch==2.13.0

.PHONY: setup demo test

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

demo: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" bash examples/reverse_text/run.sh

test: setup
	$(BIN)/python -m pytest -q
