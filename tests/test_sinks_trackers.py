"""Rows that really arrive in W&B (offline run file read back) and MLflow (a real server)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

import gpulens
from gpulens.sinks.mlflow import MlflowSink, mlflow_key
from gpulens.testing import SimulatedNVML
from tests.support.mlflow_server import MlflowServer, MlflowTracking
from tests.support.wandb_reader import (
    read_history,
    read_metric_definitions,
    wait_for_finished_run,
)


def _history_of(wandb_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """The run's history, once wandb-core has written the run's exit record."""
    return read_history(wait_for_finished_run(wandb_dir, run_id))


def _train(mon: gpulens.Monitor, steps: int, dt: float = 0.05) -> None:
    for step in range(1, steps + 1):
        time.sleep(dt)
        mon.log(step, loss=1.0 / step, learning_rate=0.1, grad_norm=3.0)


def test_wandb_rows_on_train_global_step(wandb_offline: Path) -> None:
    import wandb

    run = wandb.init(project="gpulens-test")
    run.log({"custom": 1.0})  # the user's own logging goes on beside gpulens
    with gpulens.Monitor(interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=2)) as mon:
        _train(mon, 5)
    run_id = run.id
    wandb.finish()
    history = _history_of(wandb_offline, run_id)
    rows = [h for h in history if "gpu/0/power_w" in h]
    assert [h["train/global_step"] for h in rows] == [1, 2, 3, 4, 5]
    assert all("gpu/1/sm_active_pct" in h and "train/loss" in h for h in rows)
    assert rows[-1]["train/loss"] == pytest.approx(0.2)
    # W&B's own step was never passed: it counts the log calls, one each
    assert [h["_step"] for h in history] == list(range(len(history)))
    defs = read_metric_definitions(wait_for_finished_run(wandb_offline, run_id))
    globs = {d.glob: d.step_metric for d in defs if d.glob}
    assert globs["gpu/*"] == "train/global_step" and globs["train/*"] == "train/global_step"


def test_wandb_without_a_run_starts_and_finishes_one(wandb_offline: Path) -> None:
    import wandb

    with gpulens.Monitor(interval=0.05, sinks=["wandb"], backend=SimulatedNVML(gpus=1)) as mon:
        assert wandb.run is not None
        run_id = wandb.run.id
        _train(mon, 3)
    assert wandb.run is None
    history = _history_of(wandb_offline, run_id)
    assert [h["train/global_step"] for h in history if "gpu/0/power_w" in h] == [1, 2, 3]


def _history(tracking: MlflowTracking, run_id: str, key: str) -> list[Any]:
    return list(tracking.client().get_metric_history(run_id, key))


def test_mlflow_rows_on_training_steps(mlflow_tracking: MlflowTracking) -> None:
    import mlflow

    with mlflow.start_run() as run, gpulens.Monitor(
        interval=0.05, sinks=["mlflow"], backend=SimulatedNVML(gpus=2)
    ) as mon:
        _train(mon, 4)
    run_id = run.info.run_id
    power = _history(mlflow_tracking, run_id, "gpu/1/power_w")
    assert sorted(m.step for m in power) == [1, 2, 3, 4]
    assert all(70 <= m.value <= 700 for m in power)
    loss = _history(mlflow_tracking, run_id, "train/loss")
    assert sorted((m.step, round(m.value, 4)) for m in loss) == [
        (1, 1.0), (2, 0.5), (3, 0.3333), (4, 0.25)]
    # the user's run stays the user's: still recorded as one run in this experiment
    assert len(mlflow_tracking.runs()) == 1


def test_mlflow_without_active_run_makes_one(mlflow_tracking: MlflowTracking) -> None:
    with gpulens.Monitor(interval=0.05, sinks=["mlflow"], backend=SimulatedNVML(gpus=1)) as mon:
        _train(mon, 2)
    (run,) = mlflow_tracking.runs()
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in _history(mlflow_tracking, run.info.run_id,
                                           "gpu/0/energy_j")) == [1, 2]


def test_mlflow_key_is_valid() -> None:
    assert mlflow_key("gpu/0/power_w") == "gpu/0/power_w"
    assert mlflow_key("train/loss@top:1") == "train/loss_top_1"


def test_mlflow_server_gone_mid_run(
    mlflow_server_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """log() stays fast, stop() returns in bounded time, undelivered rows are counted."""
    from mlflow import MlflowClient

    server: MlflowServer = mlflow_server_factory()
    client = MlflowClient(server.uri)
    run_id = client.create_run("0").info.run_id
    sink = MlflowSink(run_id, tracking_uri=server.uri)
    mon = gpulens.Monitor(interval=0.05, sinks=[sink], backend=SimulatedNVML(gpus=1))
    mon.start()
    for step in (1, 2):
        time.sleep(0.05)
        mon.log(step)
    time.sleep(1.5)  # rows 1-2 delivered
    assert sorted(m.step for m in client.get_metric_history(run_id, "gpu/0/power_w")) == [1, 2]
    server.stop()
    worst = 0.0
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        for step in range(3, 23):
            time.sleep(0.02)
            t = time.perf_counter()
            mon.log(step)
            worst = max(worst, time.perf_counter() - t)
        t = time.perf_counter()
        stats = mon.stop(timeout=3)
        stop_s = time.perf_counter() - t
    assert worst < 0.05, f"log() took {worst * 1e3:.1f} ms with the server down"
    assert stop_s < 15
    st = stats["MlflowSink"]
    assert st.written == 2 and st.dropped == 20
    assert any("20 dropped" in r.message for r in caplog.records)
