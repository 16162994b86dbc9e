"""``import gpulens`` stays light: no vendor, framework or tracker is imported with it.

Each check runs in a fresh interpreter, since this test session itself imports all of them.
Only the standard library and the core dependencies (nvidia-ml-py's ``pynvml``, ``psutil``)
may come in with the modules below; pynvml may also be imported lazily, later.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The optional, heavy packages named by the design: never imported by ``import gpulens``.
HEAVY = (
    "torch",
    "wandb",
    "mlflow",
    "transformers",
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "prometheus_client",
    "rich",
    "hydra",
    "omegaconf",
)
# Top-level packages allowed besides the standard library: gpulens and its core dependencies.
CORE = ("gpulens", "pynvml", "psutil")

LIGHT_MODULES = (
    "gpulens", "gpulens.schema", "gpulens.model", "gpulens.sinks", "gpulens.sinks.base",
    "gpulens.tune",  # torch comes with a sweep, not with the package
    "gpulens.distributed.rows",  # the gather's per-row work, run by a one-node job's engines
)

_PROBE = """
import json, sys
before = set(sys.modules)
import importlib
importlib.import_module(sys.argv[1])
after = set(sys.modules)
print(json.dumps(sorted(after - before)))
"""


def _new_modules(module: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", _PROBE, module],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"import {module} failed:\n{result.stderr}"
    new: list[str] = json.loads(result.stdout.strip().splitlines()[-1])
    return new


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_import_brings_no_heavy_package(module: str) -> None:
    tops = {name.split(".")[0] for name in _new_modules(module)}
    assert "gpulens" in tops  # the probe did import it, in a fresh interpreter
    heavy = sorted(tops.intersection(HEAVY))
    assert heavy == [], f"import {module} imported {heavy}: import them where they are used"


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_import_brings_only_stdlib_and_core_dependencies(module: str) -> None:
    tops = {name.split(".")[0] for name in _new_modules(module)}
    foreign = sorted(
        top
        for top in tops
        if top not in sys.stdlib_module_names and top not in CORE
    )
    assert foreign == [], (
        f"import {module} imported {foreign}, which are not declared core dependencies "
        f"({', '.join(CORE[1:])}): a plain `pip install gpulens` would not have them"
    )


def test_a_start_without_wandb_imports_no_wandb_module(tmp_path: Path) -> None:
    """A monitor with a JSONL sink imports neither wandb nor gpulens's W&B sink in the
    training process (the W&B finish hook looks for W&B sinks without importing them)."""
    probe = (
        "import json, sys, gpulens\n"
        f"with gpulens.Monitor(sinks=['jsonl:{tmp_path / 'r.jsonl'}'], interval=0.05) as m:\n"
        "    m.log(1, loss=1.0)\n"
        "print(json.dumps(sorted(n for n in sys.modules if 'wandb' in n)))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "GPULENS_BACKEND": "simulated"},
                            check=False)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert loaded & {"wandb", "gpulens.sinks.wandb"} == set(), loaded
