"""The MLflow sink against a local SQLite store: a store whose tables another process is making
at the moment the sink opens, and a backlog of rows written in few calls."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from gpulens.model import Row, RunContext
from gpulens.sinks.mlflow import MlflowSink

# MLflow's SQLite store (SQLAlchemy) warns of its own deprecated calls: not this test's subject
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONTEXT = RunContext(gpus=(), backend="simulated", hostname="h", interval=0.05)


def _row(step: int) -> Row:
    return Row(step=step, time=time.time(), values={"train/loss": 1.0 / step,
                                                    "perf/step_time_s": 0.01,
                                                    "train/global_step": float(step)})


def test_mlflow_sink_opens_a_store_whose_tables_another_process_was_making(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh ``sqlite:///`` store touched first by the training process's own MLflow calls
    while the engine's sink opens: MLflow's table creation in one process fails ("table ...
    already exists", alembic's "Online migration expected to match one row") when the other
    made them meanwhile. The sink tries again, finds the tables made, and writes its rows."""
    pytest.importorskip("mlflow")
    import mlflow.store.db.utils as db_utils
    import sqlalchemy.exc
    from mlflow.tracking import MlflowClient

    real = db_utils._initialize_tables
    raced: list[int] = []

    def initialize_while_another_process_does(engine: Any) -> None:
        real(engine)  # the other process made the tables ...
        if not raced:  # ... so this process's own attempt failed, once
            raced.append(1)
            raise sqlalchemy.exc.OperationalError(
                "CREATE TABLE experiments", {}, Exception("table experiments already exists"))

    monkeypatch.setattr(db_utils, "_initialize_tables", initialize_while_another_process_does)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sink = MlflowSink(tracking_uri=uri)
    sink.open(CONTEXT)
    sink.write(_row(1))
    sink.close()
    assert raced == [1]
    client = MlflowClient(uri)
    (run,) = client.search_runs(["0"])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id,
                                                                "train/loss")] == [(1, 1.0)]


def test_mlflow_sink_writes_a_backlog_in_few_calls(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that wait (fast steps: 2,000 steps of 1 ms left ``stop()`` waiting 20 s on a
    SQLite store, 76 s on a loopback server, one ``log_batch`` call a row) go out several to a
    call, each on its own step, and are all counted written."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from gpulens.sinks.writer import StepLogger

    calls: list[int] = []
    real = MlflowClient.log_batch

    def counting(self: Any, run_id: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(kwargs.get("metrics") or ()))
        return real(self, run_id, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", counting)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    writer = StepLogger([MlflowSink(tracking_uri=uri)], names=["mlflow"])
    for step in range(1, 301):  # waiting before the sink opens: a backlog
        writer.submit(_row(step))
    writer.open(CONTEXT)
    stats = writer.close(120.0, 60.0)
    assert (stats["mlflow"].written, stats["mlflow"].dropped) == (300, 0)
    client = MlflowClient(uri)
    (run,) = client.search_runs(["0"])
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id,
                                                                          "train/loss"))
    assert history == [(s, 1.0 / s) for s in range(1, 301)]
    assert len([n for n in calls if n]) <= 10, calls


def test_mlflow_sink_writes_into_the_run_of_mlflow_run_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``MLFLOW_RUN_ID`` (set by ``mlflow run``, or by hand) names the run MLflow's own fluent
    calls log into when no run is started: the sink writes there too, and neither makes a
    second run nor ends that one."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    made = client.create_run("0").info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", made)
    sink = MlflowSink(tracking_uri=uri)
    sink.prepare()  # the training process, at start()
    assert sink.run_id == made
    engine = MlflowSink(tracking_uri=uri)  # an engine that was handed no run id
    for s in (sink, engine):
        s.open(CONTEXT)
    sink.write(_row(1))
    engine.write(_row(2))
    for s in (sink, engine):
        s.close()
    assert [r.info.run_id for r in client.search_runs(["0"])] == [made]
    assert [m.step for m in client.get_metric_history(made, "train/loss")] == [1, 2]
    assert client.get_run(made).info.status == "RUNNING"  # the user's run: theirs to end

