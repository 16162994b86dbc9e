"""Accelerate: ``attach(accelerator)`` writes GPU rows into the trackers Accelerate started
(an offline W&B run read back from its file, MLflow on a real loopback server), on the user's
own ``accelerator.log(..., step=)`` steps; ``MergingLogger`` wraps an ``Accelerator`` too."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.mlflow_server import MlflowTracking
from tests.support.wait import wait_until
from tests.support.wandb_offline import reset_wandb
from tests.support.wandb_reader import (
    find_run_file,
    read_history,
    read_metric_definitions,
    run_script_that_raises,
)

accelerate = pytest.importorskip("accelerate")

from gpulens.integrations.accelerate import GPUTracker, attach  # noqa: E402
from gpulens.integrations.verl import MergingLogger  # noqa: E402
from tests.support.jsonl import read_rows  # noqa: E402

GPU_KEY = "gpu/0/power_w"


@pytest.fixture(autouse=True)
def _simulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "1")
    yield
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def accelerator(log_with: list[str]) -> Any:
    return accelerate.Accelerator(cpu=True, log_with=log_with)


def mlflow_steps(tracking: MlflowTracking, run: Any, key: str) -> list[int]:
    return sorted(m.step for m in tracking.client().get_metric_history(run.info.run_id, key))


def wait_for_gpu_rows(tracking: MlflowTracking, key: str) -> None:
    """Until the engine process has written a GPU row into the run. It opens MLflow (imports
    it) while training goes on; on a loaded machine that took longer than stop()'s 20 s
    without progress (loaded run 3 of issue 20), and stop() rightly dropped the rows."""
    def written() -> list[int]:
        runs = tracking.runs()
        return mlflow_steps(tracking, runs[0], key) if runs else []
    wait_until(written, timeout=240, what=f"a GPU row ({key}) in the MLflow run")


def test_rows_go_into_the_wandb_and_mlflow_runs_accelerate_started(
        tmp_path: Path, wandb_offline: Path, mlflow_tracking: MlflowTracking) -> None:
    acc = accelerator(["wandb", "mlflow"])
    acc.init_trackers(mlflow_tracking.experiment_name, config={"lr": 0.1})
    sink = tmp_path / "gpu.jsonl"
    tracker = attach(acc, interval=0.05, sinks=[f"jsonl:{sink}"])
    assert isinstance(tracker, GPUTracker) and acc.trackers[0] is tracker
    steps = 30
    for step in range(1, steps + 1):
        time.sleep(0.04)
        acc.log({"loss": 1.0 / step, "val/acc": float(step)}, step=step)
    wait_for_gpu_rows(mlflow_tracking, "gpu_power_w_mean")
    acc.end_training()
    reset_wandb()

    path = find_run_file(wandb_offline)
    history = read_history(path)
    user = [h for h in history if "loss" in h]
    # every one of the user's values, on the user's step (W&B dropped none)
    assert [(h["_step"], round(1 / h["loss"])) for h in user] == [
        (s, s) for s in range(1, steps + 1)]
    assert all(h["val/acc"] == h["_step"] for h in user)
    # every GPU row once, on its true step; the first log() starts the first window
    assert sorted(h["gpulens/step"] for h in history if "gpulens/step" in h) == list(
        range(2, steps + 1))
    assert not any("train/loss" in h for h in history)  # the user's numbers: Accelerate's own
    defs = {d.name: d.step_metric for d in read_metric_definitions(path) if d.name}
    assert defs[GPU_KEY] == "gpulens/step"

    (run,) = mlflow_tracking.runs()  # Accelerate's run, none of gpulens
    assert mlflow_steps(mlflow_tracking, run, "loss") == list(range(1, steps + 1))
    # MLflow gets the tracker view: bare keys, beside Accelerate's bare "loss"
    assert mlflow_steps(mlflow_tracking, run, "gpu_power_w_mean") == list(range(2, steps + 1))

    rows = read_rows(sink)
    assert [r["step"] for r in rows] == list(range(2, steps + 1))
    assert {r["perf/steps"] for r in rows} == {1.0}
    assert all(r["train/loss"] == pytest.approx(1 / r["step"]) for r in rows)
    assert all(r["train/val/acc"] == r["step"] for r in rows)


def test_start_step_and_several_logs_at_one_step(mlflow_tracking: MlflowTracking,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULENS_TRACKER_KEYS", "all")  # every key, perf/steps included
    acc = accelerator(["mlflow"])
    acc.init_trackers(mlflow_tracking.experiment_name)
    attach(acc, interval=0.05, start_step=100)  # a run resumed at step 100
    for step in range(101, 106):
        time.sleep(0.04)
        acc.log({"loss": 1.0}, step=step)
        acc.log({"eval/loss": 2.0}, step=step)  # a second log at the same step
    wait_for_gpu_rows(mlflow_tracking, GPU_KEY)
    acc.end_training()
    (run,) = mlflow_tracking.runs()
    assert mlflow_steps(mlflow_tracking, run, GPU_KEY) == [101, 102, 103, 104, 105]
    perf = mlflow_tracking.client().get_metric_history(run.info.run_id, "perf/steps")
    assert sorted((m.step, m.value) for m in perf) == [(s, 1.0) for s in range(101, 106)]


def test_the_first_log_starts_the_monitor_on_the_engine_process_spawned_at_attach(
    mlflow_tracking: MlflowTracking, tmp_path: Path,
) -> None:
    """Attached without a start step, the monitor starts at the first ``log()``, inside
    training: its engine process is spawned at ``attach``, and that start takes it."""
    from gpulens.transport import spawn

    acc = accelerator(["mlflow"])
    acc.init_trackers(mlflow_tracking.experiment_name)
    tracker = attach(acc, sinks=[f"jsonl:{tmp_path / 'rows.jsonl'}"], interval=0.05)
    spare = spawn._spare
    assert spare is not None, "attached, not yet started: a spare engine process waits"
    acc.log({"loss": 1.0}, step=1)
    try:
        assert tracker.monitor._transport.pid == spare.proc.pid
        assert spawn._spare is None
    finally:
        acc.end_training()


def test_attach_before_init_trackers_is_a_clear_error() -> None:
    acc = accelerator(["mlflow"])
    with pytest.raises(ValueError, match=r"after accelerator\.init_trackers"):
        attach(acc)


def test_merging_logger_wraps_an_accelerator(mlflow_tracking: MlflowTracking) -> None:
    """``MergingLogger.from_config(accelerator, cfg)`` forwards ``accelerator.log(values,
    step=)`` (Accelerator.log has no ``data=``)."""
    acc = accelerator(["mlflow"])
    acc.init_trackers(mlflow_tracking.experiment_name)
    cfg = {"trainer": {"enable_gpu_monitoring": True, "gpu_monitor_interval": 0.05}}
    logger = MergingLogger.from_config(acc, cfg)
    for step in range(1, 7):
        time.sleep(0.04)
        logger.log(data={"loss": 1.0 / step}, step=step)
    logger.close()
    acc.end_training()
    (run,) = mlflow_tracking.runs()
    assert mlflow_steps(mlflow_tracking, run, "loss") == [1, 2, 3, 4, 5, 6]
    # the trackers' view (the accelerator's trackers cannot hide the per-GPU detail)
    assert mlflow_steps(mlflow_tracking, run, "train/gpu_power_w_mean") == [2, 3, 4, 5, 6]
    assert mlflow_steps(mlflow_tracking, run, GPU_KEY) == []


ACCELERATE_SCRIPT_THAT_RAISES = '''
import time
import accelerate
from gpulens.integrations.accelerate import attach

acc = accelerate.Accelerator(cpu=True, log_with=["wandb"])
acc.init_trackers("gpulens-test")
attach(acc, interval=0.05)
for step in range(1, 21):
    time.sleep(0.1)
    if step == 20:
        raise RuntimeError("boom at step 20")   # no end_training()
    acc.log({"loss": 1.0 / step}, step=step)
'''


def test_rows_reach_wandb_when_the_script_raises_without_end_training(
        tmp_path: Path, wandb_offline: Path) -> None:
    """No ``end_training()``: the rows still waiting go into the W&B run at exit, before
    W&B's own exit hook ends its service (the tracker's exit hook is the newer)."""
    stderr, history = run_script_that_raises(
        tmp_path, ACCELERATE_SCRIPT_THAT_RAISES, wandb_offline, "boom at step 20",
        env={"GPULENS_BACKEND": "simulated", "GPULENS_SIMULATED_GPUS": "1"})
    assert "rows are lost" not in stderr and "dropped" not in stderr, stderr
    assert [h["_step"] for h in history if "loss" in h] == list(range(1, 20))
    assert sorted(h["gpulens/step"] for h in history if "gpulens/step" in h) == list(
        range(2, 20))


def test_a_second_run_on_one_accelerator_attaches_again(wandb_offline: Path) -> None:
    """``end_training()``, then ``init_trackers`` and ``attach`` again (a sweep in one process):
    Accelerate keeps the finished run's trackers in its list; the second attach replaces the
    finished GPU tracker and writes into the new run only."""
    acc = accelerator(["wandb"])
    run_ids = []
    for _ in range(2):
        acc.init_trackers("gpulens-test")
        run_ids.append([t for t in acc.trackers if t.name == "wandb"][-1].tracker.id)
        attach(acc, interval=0.05)
        for step in range(1, 7):
            time.sleep(0.05)
            acc.log({"loss": 1.0 / step}, step=step)
        acc.end_training()
    reset_wandb()
    assert sum(isinstance(t, GPUTracker) for t in acc.trackers) == 1
    for run_id in run_ids:
        history = read_history(find_run_file(wandb_offline, run_id))
        assert [h["_step"] for h in history if "loss" in h] == list(range(1, 7))
        assert sorted(h["gpulens/step"] for h in history if "gpulens/step" in h) == list(
            range(2, 7))


def test_without_step_the_gpu_rows_share_the_wandb_steps_of_their_calls(
        wandb_offline: Path) -> None:
    """``accelerator.log(values)`` without ``step=``: W&B numbers the calls 0, 1, 2, ...; the
    GPU row whose window a call ended is plotted at that call's step, not one past it."""
    acc = accelerator(["wandb"])
    acc.init_trackers("gpulens-test")
    attach(acc, interval=0.05)
    for call in range(1, 9):
        time.sleep(0.1)
        acc.log({"call": float(call)})
    acc.end_training()
    reset_wandb()
    history = read_history(find_run_file(wandb_offline))
    assert [(h["_step"], h["call"]) for h in history if "call" in h] == [
        (c - 1, c) for c in range(1, 9)]
    # the first call starts the first window; each later call c ends one, at W&B step c - 1
    assert sorted(h["gpulens/step"] for h in history if "gpulens/step" in h) == list(range(1, 8))
