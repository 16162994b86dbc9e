"""Shared fixtures: a real MLflow server on loopback, offline W&B runs, and a quiet, offline
environment for the whole session.

Fixtures
- ``mlflow_server`` (session): tracking URI ``http://127.0.0.1:<port>`` of a real
  ``mlflow server`` (sqlite store in a temporary folder), stopped with its whole process group
  at the end of the session.
- ``mlflow_server_factory`` (function): starts extra, private servers a test may stop itself
  (e.g. to make the tracker unreachable mid-run); each is stopped at teardown.
- ``mlflow_tracking`` (function): points ``MLFLOW_TRACKING_URI`` (and mlflow's own global) at
  the session server and ``MLFLOW_EXPERIMENT_NAME`` at an experiment of this test alone; ends
  every active run afterwards.
- ``wandb_offline`` (function): a fresh ``WANDB_DIR`` with W&B offline and quiet; finishes any
  run still open at teardown. Read the run back with ``tests.support.wandb_reader``, after
  ``wait_for_finished_run``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.mlflow_server import MlflowServer, MlflowTracking, start_mlflow_server
from tests.support.wandb_offline import OFFLINE_ENV, reset_wandb

# Applied for the whole session so that no test, whatever it forgets, talks to a network
# service or writes tracker files into the work tree.
_SESSION_ENV = {
    **OFFLINE_ENV,
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


def _with_no_proxy(value: str | None) -> str:
    hosts = [h for h in (value or "").split(",") if h]
    for host in ("127.0.0.1", "localhost"):
        if host not in hosts:
            hosts.append(host)
    return ",".join(hosts)


@pytest.fixture(scope="session", autouse=True)
def _offline_session_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _SESSION_ENV.items():
            mp.setenv(name, value)
        mp.setenv("WANDB_DIR", str(tmp_path_factory.mktemp("wandb-session")))
        for name in ("NO_PROXY", "no_proxy"):
            mp.setenv(name, _with_no_proxy(os.environ.get(name)))
        yield
    reset_wandb()  # finish what is open, stop the wandb-core service this session started


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Tracking URI of a real MLflow server on 127.0.0.1, shared by the whole session."""
    server = start_mlflow_server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server.uri
    finally:
        server.stop()


@pytest.fixture
def mlflow_server_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[], MlflowServer]]:
    """Start private MLflow servers (``factory()`` -> ``MlflowServer``; ``.stop()`` them at
    will); every one still running is stopped at teardown. Each start takes ~5-10 s."""
    servers: list[MlflowServer] = []

    def factory() -> MlflowServer:
        server = start_mlflow_server(tmp_path_factory.mktemp("mlflow-private"))
        servers.append(server)
        return server

    try:
        yield factory
    finally:
        for server in servers:
            server.stop()


def _experiment_name(node: pytest.Item) -> str:
    return "test-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", node.nodeid)[-200:]


@pytest.fixture
def mlflow_tracking(
    mlflow_server: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[MlflowTracking]:
    """Point MLflow at the session server for one test, in an experiment of its own."""
    import mlflow

    tracking = MlflowTracking(uri=mlflow_server, experiment_name=_experiment_name(request.node))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking.uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", tracking.experiment_name)
    # set then delete, so that teardown restores "unset" even if the test (or a framework's
    # own MLflow integration calling mlflow.set_experiment) sets it
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID")
    mlflow.set_tracking_uri(tracking.uri)
    # mlflow.set_experiment() in an earlier test leaves a process-wide active experiment that
    # outranks MLFLOW_EXPERIMENT_NAME: make this test's experiment the active one.
    mlflow.set_experiment(tracking.experiment_name)
    try:
        yield tracking
    finally:
        while mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(None)  # type: ignore[arg-type]  # None resets to the env var
        # Undo set_experiment() (no public API for it), so that a later test on another
        # server does not start runs in this server's experiment id.
        import mlflow.tracking.fluent

        mlflow.tracking.fluent._active_experiment_id = None


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh ``WANDB_DIR`` (returned) for an offline, quiet W&B run of this test.

    The run's file ends up at ``<dir>/wandb/offline-run-*/run-<id>.wandb``; after
    ``wandb.finish()`` get it with ``tests.support.wandb_reader.wait_for_finished_run(dir,
    run_id)`` (wandb-core may still be writing it when finish() returns). wandb's
    settings singleton is reset before and after, so this test's environment is the one used.
    """
    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    reset_wandb()
    for name, value in OFFLINE_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    for name in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield wandb_dir
    finally:
        reset_wandb()
