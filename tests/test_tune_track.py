"""A sweep's result into the user's tracker run: an offline W&B run read back from its file,
an MLflow run on a real server on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpulens.tune import Config, log_to_tracker
from tests.support.mlflow_server import MlflowTracking
from tests.support.wandb_reader import read_history, read_summary, wait_for_finished_run
from tests.test_tune_sweep import Formula, bent, run


def result_with_oom() -> object:
    return run(Formula(compute=bent(32, 0.002), per_sample_load_s=0.0015, oom_at=128),
               current=Config(8, 0), workers=(0, 1, 2))


def test_wandb_run_gets_the_choice_and_the_trials(wandb_offline: Path) -> None:
    import wandb

    result = result_with_oom()
    run_ = wandb.init(project="gpulens-tune-test")
    log_to_tracker(result, run_)
    run_id = run_.id
    run_.finish()
    path = wait_for_finished_run(wandb_offline, run_id)
    summary = read_summary(path)
    assert summary["tune/batch_size"] == 32 and summary["tune/num_workers"] == 2
    assert summary["tune/oom_batch"] == 128 and summary["tune/speedup_pct"] > 0
    row = {k: v for r in read_history(path) for k, v in r.items()}
    assert row["tune/trials._type"] == "table-file" and row["tune/report._type"] == "html-file"


def test_wandb_training_logged_from_step_0_after_the_result_keeps_its_rows(
        wandb_offline: Path) -> None:
    """The result goes into the run's pending row: a training that then logs with
    ``step=global_step`` from 0 (into the same run) loses no row to a step the result took."""
    import wandb

    run_ = wandb.init(project="gpulens-tune-test")
    log_to_tracker(result_with_oom(), run_)
    for step in range(3):
        run_.log({"loss": 1.0 / (step + 1)}, step=step)
    run_id = run_.id
    run_.finish()
    history = read_history(wait_for_finished_run(wandb_offline, run_id))
    assert [r["_step"] for r in history if "loss" in r] == [0, 1, 2]
    assert [r["_step"] for r in history if "tune/trials._type" in r] == [0]


def test_mlflow_run_gets_params_metrics_and_artifacts(mlflow_tracking: MlflowTracking) -> None:
    import mlflow

    result = result_with_oom()
    with mlflow.start_run() as active:
        log_to_tracker(result, active)
    client = mlflow.MlflowClient()
    data = client.get_run(active.info.run_id).data
    assert data.params["tune.batch_size"] == "32" and data.params["tune.num_workers"] == "2"
    assert data.metrics["tune_oom_batch"] == 128 and data.metrics["tune_samples_per_s"] > 0
    files = {a.path for a in client.list_artifacts(active.info.run_id)}
    assert {"gpulens_tune.json", "gpulens_tune.html", "gpulens_tune.md"} <= files


def test_another_object_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="pass a W&B run"):
        log_to_tracker(result_with_oom(), object())  # type: ignore[arg-type]
