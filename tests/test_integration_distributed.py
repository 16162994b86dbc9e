"""Distributed jobs: ``torchrun --nproc_per_node 2`` on CPU (gloo) with simulated GPUs, one per
rank, for the plain loop, the Hugging Face Trainer and Lightning. Rank 0 alone writes; each row
holds both ranks' GPUs (keyed by global rank) and the job-level ``gpu/all/*`` aggregates, on
exactly the framework's logging steps."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.jsonl import read_rows

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RANK_KEYS = ("gpu/0/util_pct", "gpu/1/util_pct", "gpu/all/util_pct_mean",
             "gpu/all/util_pct_min", "gpu/all/util_pct_max", "gpu/0/power_w", "gpu/1/power_w")


# torch's gloo teardown at interpreter exit sometimes aborts a rank after the script has
# finished ("terminate called without an active exception", SIGABRT): seen about 1 run in 10
# on this project's 2-core machine, with gpulens's sampler in a thread (commit 41b28a7) as with
# it in a process.  Such a run is tried once more; any other failure fails the test at once.
EXIT_ABORT = "terminate called without an active exception"


def torchrun(args: list[str], cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULENS_")}
    env.update(GPULENS_BACKEND="simulated", OMP_NUM_THREADS="1")
    for attempt in (1, 2):
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
             "2", *args],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=240,
        )
        if done.returncode == 0 or EXIT_ABORT not in done.stderr or attempt == 2:
            break
        for leftover in cwd.iterdir():  # the retry starts from nothing (no version_1 logs)
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-6000:])


def jsonl(path: Path) -> list[dict[str, Any]]:
    return read_rows(path)


def check_rows(rows: list[dict[str, Any]], steps: list[int]) -> None:
    assert [r["step"] for r in rows] == steps  # one row per log: only rank 0 wrote
    for row in rows:
        for key in RANK_KEYS:
            assert key in row, key
        assert not any(k.startswith("gpu/2/") for k in row)
        assert row["gpu/all/util_pct_min"] <= row["gpu/all/util_pct_mean"] \
            <= row["gpu/all/util_pct_max"]


def test_plain_loop_ddp(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    torchrun([str(EXAMPLES / "plain_loop.py"), "--out", str(out), "--steps", "30",
              "--log-every", "10"], tmp_path)
    rows = jsonl(out)
    check_rows(rows, [10, 20, 30])
    assert all("train/loss" in r and "perf/data_wait_pct" in r for r in rows)


def test_hf_trainer_ddp(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    torchrun([str(EXAMPLES / "hf_trainer.py"), "--output-dir", str(tmp_path / "out"),
              "--max-steps", "12", "--logging-steps", "4"], tmp_path)
    rows = jsonl(tmp_path / "out" / "gpulens.jsonl")
    check_rows(rows, [4, 8, 12])
    assert all("train/loss" in r for r in rows)


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_ddp(tmp_path: Path, package: str) -> None:
    pytest.importorskip(package)
    sink = tmp_path / "rows.jsonl"
    torchrun([str(EXAMPLES / "lightning_fit.py"), "--package", package, "--save-dir",
              str(tmp_path), "--max-steps", "12", "--log-every", "4", "--sink",
              f"jsonl:{sink}"], tmp_path)
    check_rows(jsonl(sink), [3, 7, 11])
    (metrics,) = tmp_path.rglob("metrics.csv")  # one logger file: rank 0's
    with open(metrics) as f:
        logged = list(csv.DictReader(f))
    loss_steps = sorted({int(r["step"]) for r in logged if r["train_loss"]})
    gpu_steps = sorted({int(r["step"]) for r in logged if r.get("gpu/1/util_pct")})
    assert loss_steps == gpu_steps == [3, 7, 11]
