# gpulens: two commands on a fresh machine with Python >= 3.10 (3.11 here) and no GPU.
#   make demo   make .venv, install, run examples/demo.py (a short real training with gpulens on)
#   make test   make .venv, install, run ruff, mypy (strict) and pytest
# Other targets: lint (ruff + mypy), pytest (tests only), clean (outputs, including the Hydra
# example's outputs/ and multirun/, and caches),
# distclean (clean + .venv).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The stamp says "installed from this pyproject.toml"; a newer pyproject.toml reinstalls.
STAMP := $(VENV)/.installed
# The CPU build of torch lies on this machine's disk (pip's find-links); it is installed
# FIRST so that nothing asking for "torch" later pulls a CUDA build of several GB.
# pip runs with -qq: this machine's pip config names local indexes that warn once per missing
# package; errors still show.
TORCH_PIN := torch==2.13.0
LINT_PATHS := $(wildcard src tests examples benchmarks integrations)
PYTEST_ARGS ?=

.PHONY: venv $(VENV) test lint pytest demo clean distclean

venv $(VENV): $(STAMP)

# pip -qq prints nothing for minutes: each step says what it installs, and when it started.
say = echo "gpulens make [$$(date +%H:%M:%S)] $(1)"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || { $(call say,making the virtual environment $(VENV) with $(PYTHON)); $(PYTHON) -m venv $(VENV); }
	@$(call say,installing into $(VENV): 3 steps; pip is quiet meanwhile. The first install takes a few minutes.)
	@$(call say,[1/3] upgrading pip)
	@$(BIN)/python -m pip install --quiet --quiet --upgrade pip
	@$(call say,[2/3] installing $(TORCH_PIN) (the CPU build; about a minute))
	@$(BIN)/python -m pip install --quiet --quiet '$(TORCH_PIN)'
	@$(call say,[3/3] installing gpulens with every extra (transformers accelerate lightning pytorch-lightning mlflow wandb wandb-workspaces hydra-core rich prometheus-client) and the dev tools (pytest ruff mypy): 2-3 minutes on a fresh machine)
	@$(BIN)/python -m pip install --quiet --quiet -e '.[all,dev]'
	@$(BIN)/python -c 'import sys, torch; v = torch.__version__; sys.exit(None if v.split("+")[0] == "2.13.0" else f"torch {v} replaced 2.13.0")'
	@touch $@
	@$(call say,$(VENV) is ready)

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/mypy

# pytest's exit code 5 ("no tests collected") is a failure here, like any non-zero code.
pytest: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test: lint pytest

demo: $(STAMP)
	$(BIN)/python examples/demo.py

clean:
	rm -rf build dist .mypy_cache .ruff_cache .pytest_cache demo-output runs mlruns wandb
	rm -rf outputs multirun
	rm -rf src/*.egg-info
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
