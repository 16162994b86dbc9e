# gpulens: two commands on a fresh machine with Python >= 3.10 (3.11 here) and no GPU.
#   make demo   make .venv, install, run examples/demo.py (a short real training with gpulens on)
#   make test   make .venv, install, run ruff, mypy (strict) and pytest
# Other targets: lint (ruff + mypy), pytest (tests only), clean (outputs and caches),
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

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --quiet '$(TORCH_PIN)'
	$(BIN)/python -m pip install --quiet --quiet -e '.[all,dev]'
	$(BIN)/python -c 'import sys, torch; v = torch.__version__; sys.exit(None if v.split("+")[0] == "2.13.0" else f"torch {v} replaced 2.13.0")'
	touch $@

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
	rm -rf src/*.egg-info
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
