# gpulens: two commands on a fresh machine with Python >= 3.10 (3.11 here) and no GPU.
#   make demo   make .venv, install, run examples/demo.py (a short real training with gpulens on)
#   make test   make .venv, install, run ruff, then mypy (strict) beside pytest
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
# before the rest so that nothing asking for "torch" later pulls a CUDA build of several GB:
# by uv from those find-links, asking for the local version "+cpu" by name (no index has it,
# so uv can only take the wheel on disk; ~5 s instead of pip's ~45 s), else by pip as before.
# pip runs with -qq: this machine's pip config names local indexes that warn once per missing
# package; errors still show.
TORCH_PIN := torch==2.13.0
# The rest is installed by uv (from PyPI, installed beside the environment so that the
# environment holds exactly what pip would put there): the same packages and versions as
# `pip install -e '.[all,dev]'` (pip freeze compared), in ~15 s instead of ~2 minutes. The
# pin is passed again so that uv keeps the CPU build installed in step 3 (it never replaces a
# requirement already satisfied); the check after step 4 fails the install if it did.
# Where uv cannot be installed, pip does that step as before.
# uv compiles the packages' bytecode as it installs (--compile-bytecode, ~20 s; pip does it by
# default): where PYTHONDONTWRITEBYTECODE is set, as on this machine and in CI, no process would
# ever write it, and every test process that imports torch, transformers and Lightning compiled
# them from source again (~7 s of CPU each: make test took 391 s of pytest instead of 245 s).
UV_DIR := $(VENV)/.uv
UV := $(UV_DIR)/bin/uv
LINT_PATHS := $(wildcard src tests examples benchmarks integrations)
PYTEST_ARGS ?=
# pytest-xdist workers. The suite mostly waits (engine processes, servers, subprocesses that
# import torch), so more workers than this machine's 2 cores pay (docs/design-notes.md).
PYTEST_WORKERS ?= 4

.PHONY: venv $(VENV) test lint pytest demo clean distclean

venv $(VENV): $(STAMP)

# pip -qq prints nothing for minutes: each step says what it installs, and when it started.
say = echo "gpulens make [$$(date +%H:%M:%S)] $(1)"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || { $(call say,making the virtual environment $(VENV) with $(PYTHON)); $(PYTHON) -m venv $(VENV); }
	@$(call say,installing into $(VENV): 4 steps; pip and uv are quiet meanwhile. The first install takes about a minute.)
	@$(call say,[1/4] upgrading pip)
	@$(BIN)/python -m pip install --quiet --quiet --upgrade pip
	@$(call say,[2/4] installing uv beside the environment ($(UV_DIR)))
	@$(BIN)/python -m pip install --quiet --quiet --target $(UV_DIR) --upgrade uv \
		|| $(call say,uv could not be installed: pip does steps 3 and 4 (2-3 minutes))
	@$(call say,[3/4] installing $(TORCH_PIN) (the CPU build, from pip's find-links on this machine))
	@links="$${PIP_FIND_LINKS:-$$($(BIN)/python -m pip config get global.find-links 2>/dev/null || true)}"; \
	if test -x $(UV) && test -n "$$links" && \
		$(UV) pip install --quiet --compile-bytecode --python $(BIN)/python --find-links "$$links" '$(TORCH_PIN)+cpu'; then :; \
	else \
		$(BIN)/python -m pip install --quiet --quiet '$(TORCH_PIN)'; \
	fi
	@$(call say,[4/4] installing gpulens with every extra (transformers accelerate lightning pytorch-lightning mlflow wandb wandb-workspaces hydra-core rich prometheus-client) and the dev tools (pytest pytest-xdist ruff mypy))
	@if test -x $(UV); then \
		$(UV) pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[all,dev]' '$(TORCH_PIN)'; \
	else \
		$(BIN)/python -m pip install --quiet --quiet -e '.[all,dev]'; \
	fi
	@$(BIN)/python -c 'import sys, torch; v = torch.__version__; sys.exit(None if v.split("+")[0] == "2.13.0" and torch.version.cuda is None else f"torch {v} (CUDA {torch.version.cuda}) replaced 2.13.0+cpu")'
	@touch $@
	@$(call say,$(VENV) is ready)

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/mypy

# pytest's exit code 5 ("no tests collected") is a failure here, like any non-zero code.
# Tests run in $(PYTEST_WORKERS) worker processes; those of one xdist_group run in one worker,
# one after another (tests/conftest.py says which and why). PYTEST_WORKERS=0: no workers.
# One intra-op torch thread per test process: the workers (and the children they start) would
# each spin two OpenMP threads on two cores (an example's run took 6.5-7.8 s of CPU with two,
# 4.3 s with one); a test that needs more sets its own.
PYTEST := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -p no:cacheprovider \
	-n $(PYTEST_WORKERS) --dist loadgroup

pytest: $(STAMP)
	$(PYTEST) $(PYTEST_ARGS)

# ruff, then mypy (a minute of CPU on a cold cache) beside pytest: its output goes to
# $(VENV)/mypy.log and is shown once pytest is done; either failing fails the target.
test: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	@echo "$(BIN)/mypy > $(VENV)/mypy.log (beside pytest)"
	@$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & mypy_pid=$$!; \
	set +e; $(PYTEST) $(PYTEST_ARGS); pytest_rc=$$?; \
	wait $$mypy_pid; mypy_rc=$$?; set -e; \
	echo "$(BIN)/mypy (exit $$mypy_rc):"; cat $(VENV)/mypy.log; \
	if [ $$pytest_rc -ne 0 ]; then echo "pytest failed (exit $$pytest_rc)"; exit $$pytest_rc; fi; \
	exit $$mypy_rc

demo: $(STAMP)
	$(BIN)/python examples/demo.py

clean:
	rm -rf build dist .mypy_cache .ruff_cache .pytest_cache demo-output runs mlruns wandb
	rm -rf outputs multirun
	rm -rf src/*.egg-info
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
