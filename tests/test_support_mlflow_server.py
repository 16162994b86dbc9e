"""The MLflow server fixture: a real server on loopback that keeps what is logged to it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from tests.support.mlflow_server import MlflowServer, MlflowTracking

# the second fixture test reads what the first left on the server: one worker, in order
pytestmark = pytest.mark.xdist_group("mlflow_support")


def test_metrics_with_explicit_run_id_and_steps_read_back(mlflow_server: str) -> None:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    assert mlflow_server.startswith("http://127.0.0.1:")
    client = MlflowClient(mlflow_server)
    experiment_id = client.create_experiment("support-explicit-run-id")
    run = client.create_run(experiment_id)
    run_id = run.info.run_id
    now_ms = int(time.time() * 1000)
    for step in (1, 2, 3):
        client.log_metric(run_id, "train/loss", 1.0 / step, timestamp=now_ms + step, step=step)
    client.log_batch(
        run_id,
        metrics=[
            Metric("gpu/0/util_pct", 40.0 + step, now_ms + step, step) for step in (1, 2, 3)
        ],
    )
    client.set_terminated(run_id)

    loss = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in loss] == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    util = client.get_metric_history(run_id, "gpu/0/util_pct")
    assert [(m.step, m.value, m.timestamp) for m in util] == [
        (1, 41.0, now_ms + 1),
        (2, 42.0, now_ms + 2),
        (3, 43.0, now_ms + 3),
    ]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_mlflow_tracking_fixture_points_fluent_api_at_server(
    mlflow_tracking: MlflowTracking,
) -> None:
    import mlflow

    assert os.environ["MLFLOW_TRACKING_URI"] == mlflow_tracking.uri
    assert mlflow.get_tracking_uri() == mlflow_tracking.uri
    run = mlflow.start_run()
    mlflow.log_metric("train/loss", 0.25, step=7)
    # left active on purpose: the fixture must end it
    runs = mlflow_tracking.runs()
    assert [r.info.run_id for r in runs] == [run.info.run_id]
    history = mlflow_tracking.client().get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(7, 0.25)]


def test_mlflow_tracking_fixture_ended_the_previous_run(
    mlflow_tracking: MlflowTracking, mlflow_server: str
) -> None:
    import mlflow
    from mlflow import MlflowClient

    assert mlflow.active_run() is None
    assert mlflow_tracking.runs() == []  # an experiment of this test alone
    client = MlflowClient(mlflow_server)
    name = mlflow_tracking.experiment_name
    previous = client.get_experiment_by_name(
        name.replace("ended_the_previous_run", "points_fluent_api_at_server")
    )
    if previous is not None:  # the test above ran first: its run was ended by the fixture
        statuses = [r.info.status for r in client.search_runs([previous.experiment_id])]
        assert statuses == ["FINISHED"]


def test_private_server_stops_with_its_whole_process_group(
    mlflow_server_factory: Callable[[], MlflowServer],
) -> None:
    server = mlflow_server_factory()
    assert server.is_healthy()
    pgid = server.process.pid
    assert os.getpgid(pgid) == pgid  # its own process group
    server.stop()
    assert server.process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)  # nothing of the group is left
    assert not server.is_healthy(timeout_s=0.5)
    server.stop()  # idempotent
