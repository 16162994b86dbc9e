"""Each example runs as a user would run it (a new interpreter, simulated GPUs, CPU only) in under
a minute, and leaves the rows it promises."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.jsonl import read_rows
from tests.support.shared_run import shared_run
from tests.support.wandb_reader import find_run_file, read_history

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
LIMIT_S = 240.0  # bounds a hang: a loaded machine with the suite in workers is slow


def run_example(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPULENS_")}
    # one intra-op thread: torch's default (one per core) spins while its threads wait for
    # each other, seconds of CPU per launch on this 2-core machine with the suite in several
    # workers (hf_trainer.py: 6.5-7.8 s of CPU, 4.3 s with one thread)
    environ["OMP_NUM_THREADS"] = "1"
    environ.update(env or {})
    started = time.monotonic()
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=LIMIT_S)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-4000:]
    assert elapsed < LIMIT_S
    return done.stdout


def jsonl(path: Path) -> list[dict[str, Any]]:
    return read_rows(path)


_TAKES = """
import runpy, sys
from gpulens.transport import spawn
took, real = [], spawn.take
def take():
    got = real()
    took.append(got is not None)
    return got
spawn.take = take
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
print("spare taken:", took)
"""
"""Runs an example (the arguments after ``-c``) and says whether each start took a spare."""


def test_plain_loop(tmp_path: Path) -> None:
    """Also: the start takes the engine process that ``gpulens.setup()`` made early."""
    out = tmp_path / "rows.jsonl"
    said = run_example(["-c", _TAKES, str(EXAMPLES / "plain_loop.py"), "--out", str(out),
                        "--steps", "40", "--log-every", "10"], tmp_path)
    assert "spare taken: [True]" in said, said[-2000:]
    rows = jsonl(out)
    assert [r["step"] for r in rows] == [10, 20, 30, 40]
    for row in rows:
        assert {"gpu/0/util_pct", "train/loss", "train/learning_rate", "train/grad_norm",
                "perf/data_wait_pct", "perf/step_time_s"} <= set(row)


def test_hf_trainer(tmp_path: Path) -> None:
    run_example([str(EXAMPLES / "hf_trainer.py"), "--output-dir", str(tmp_path / "out"),
                 "--max-steps", "20", "--logging-steps", "5"], tmp_path)
    rows = jsonl(tmp_path / "out" / "gpulens.jsonl")
    assert [r["step"] for r in rows] == [5, 10, 15, 20]
    assert all("gpu/0/power_w" in r and "train/loss" in r for r in rows)


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_fit(tmp_path: Path, package: str) -> None:
    run_example([str(EXAMPLES / "lightning_fit.py"), "--package", package, "--save-dir",
                 str(tmp_path), "--max-steps", "20", "--log-every", "5"], tmp_path)
    (metrics,) = tmp_path.rglob("metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    loss_steps = sorted({int(r["step"]) for r in rows if r["train_loss"]})
    gpu_steps = sorted({int(r["step"]) for r in rows if r.get("gpu/0/util_pct")})
    assert loss_steps == gpu_steps == [4, 9, 14, 19]


def test_hydra_app_off_by_default_on_with_plus_flag(tmp_path: Path) -> None:
    env = {"GPULENS_EXAMPLE_OUT": str(tmp_path / "off")}
    out = run_example([str(EXAMPLES / "hydra_app" / "train.py")], tmp_path, env)
    assert "gpulens: off" in out
    assert not list((tmp_path / "off").rglob("*.jsonl"))

    env = {"GPULENS_EXAMPLE_OUT": str(tmp_path / "on")}
    run_example([str(EXAMPLES / "hydra_app" / "train.py"), "+trainer.enable_gpu_monitoring=true",
                 "+trainer.gpu_monitor_interval=0.05"], tmp_path, env)
    (record,) = (tmp_path / "on").rglob("gpulens.jsonl")
    rows = jsonl(record)
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert all("gpu/0/util_pct" in r and "train/loss" in r for r in rows)


@pytest.fixture(scope="module")
def hydra_group_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Hydra example with the ``gpu_monitor`` config group and a relative sink path, run as
    a user runs it, in a folder of its own and without ``GPULENS_EXAMPLE_OUT``: its run dir is
    ``outputs/hydra_app/<time>/`` there.  Returns that folder.  One launch (torch and Hydra:
    ~3 s of CPU) for the two tests below, whichever workers they run in."""
    def run(cwd: Path) -> None:
        run_example([str(EXAMPLES / "hydra_app" / "train.py"), "+gpu_monitor=default",
                     "gpu_monitor.interval=0.05", "gpu_monitor.sinks=[jsonl:gpu.jsonl]"], cwd)

    return shared_run(tmp_path_factory, "hydra-config-group", run)


def hydra_run_dir(cwd: Path) -> Path:
    (run_dir,) = (cwd / "outputs" / "hydra_app").iterdir()
    return run_dir


@pytest.mark.xdist_group("hydra-config-group")
def test_hydra_app_config_group(hydra_group_run: Path) -> None:
    assert len(jsonl(hydra_run_dir(hydra_group_run) / "gpu.jsonl")) == 8


@pytest.mark.xdist_group("hydra-config-group")
def test_hydra_example_writes_under_its_run_dir(hydra_group_run: Path) -> None:
    """A relative sink path lands in the Hydra run dir, not where the app was started (what a
    newcomer meets first: the run dir is ignored by git and removed by ``make clean``,
    tests/test_first_contact.py)."""
    run_dir = hydra_run_dir(hydra_group_run)
    assert len(read_rows(run_dir / "gpu.jsonl")) == 8
    assert (run_dir / ".hydra" / "config.yaml").exists()
    assert sorted(p.name for p in hydra_group_run.iterdir()) == ["outputs"]  # nothing else left


def test_verl_style_one_wandb_record_per_step(tmp_path: Path) -> None:
    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    run_example([str(EXAMPLES / "verl_style.py"), "+trainer.enable_gpu_monitoring=true",
                 "+trainer.gpu_monitor_interval=0.05", "trainer.logger=[console,wandb]"],
                tmp_path, {"WANDB_DIR": str(wandb_dir), "WANDB_MODE": "offline",
                           "GPULENS_EXAMPLE_OUT": str(tmp_path / "out")})
    history = read_history(find_run_file(wandb_dir))
    assert [h["_step"] for h in history] == list(range(1, 21))  # W&B's step = global_step
    assert all("actor/loss" in h and "train/gpu_util_pct_mean" in h for h in history)
    assert not any(k.startswith("gpu/") for h in history for k in h)  # the trackers' view
