"""Shared fixtures: a real MLflow server on loopback, offline W&B runs, and a quiet, offline
environment for the whole session.

Fixtures
- ``mlflow_server`` (session): tracking URI ``http://127.0.0.1:<port>`` of a real
  ``mlflow server`` (sqlite store in a temporary folder), stopped with its whole process group
  at the end of the session. Under pytest-xdist (``make test``) one server serves every
  worker: the controller starts it in the background when the session begins and stops it at
  the end; each test still has an experiment of its own (``mlflow_tracking``).
- ``mlflow_server_factory`` (function): starts extra, private servers a test may stop itself
  (e.g. to make the tracker unreachable mid-run); each is stopped at teardown.
- ``mlflow_tracking`` (function): points ``MLFLOW_TRACKING_URI`` (and mlflow's own global) at
  the session server and ``MLFLOW_EXPERIMENT_NAME`` at an experiment of this test alone; ends
  every active run afterwards.
- ``wandb_offline`` (function): a fresh ``WANDB_DIR`` with W&B offline and quiet; finishes any
  run still open at teardown. Read the run back with ``tests.support.wandb_reader``, after
  ``wait_for_finished_run``.

And a guard: a run that leaves anything new in the repository's folder or the current directory
(``mlflow.db``, ``mlruns/``, ``wandb/``, ``lightning_logs/`` ...) fails, naming what it left:
every test writes under its own ``tmp_path``. The controller checks once every worker is done
(under pytest-xdist the workers share the folder, so no worker could tell whose file it is).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.mlflow_server import (
    MlflowServer,
    MlflowServerError,
    MlflowTracking,
    start_mlflow_server,
)
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


@pytest.fixture(autouse=True)
def _no_spare_engine_left() -> Iterator[None]:
    """A framework callback's spare engine process (``gpulens.transport.spawn``) that a test
    left untaken (a Trainer built, never trained) is ended after it: the next test in this
    worker would otherwise take it, or count it among its child processes."""
    yield
    from gpulens.transport import spawn

    spawn.discard()


# -- the guard: nothing new in the work tree -----------------------------------------------------
_REPO = Path(__file__).resolve().parents[1]
_TOOL_CACHES = frozenset({".pytest_cache", ".mypy_cache", ".ruff_cache", "__pycache__",
                          ".coverage", ".hypothesis"})
"""Made by the tools themselves (``make test`` runs mypy beside pytest), not by a test."""
_folders_before = pytest.StashKey[dict[Path, frozenset[str]]]()


def _entries(folder: Path) -> frozenset[str]:
    return frozenset(name for name in os.listdir(folder)
                     if name not in _TOOL_CACHES and not name.startswith(".coverage."))


def _left_behind(before: dict[Path, frozenset[str]]) -> dict[Path, list[str]]:
    """What is in each folder now that was not there when the run began."""
    now = {folder: sorted(_entries(folder) - names) for folder, names in before.items()}
    return {folder: names for folder, names in now.items() if names}


# -- one MLflow server for all xdist workers ----------------------------------------------------
# The controller (the pytest process that starts the workers) starts the server in a thread at
# configure time, so the workers start meanwhile, and tells each worker the path of a file it
# writes once the server answers (``uri <uri>``) or failed (``error <message>``).
_SHARED_KEY = "gpulens_mlflow_uri_file"
_SHARED_WAIT_S = 300.0


class _SharedMlflow:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="gpulens-test-mlflow-"))
        self.uri_file = self.root / "uri"
        self.server: MlflowServer | None = None
        self.thread = threading.Thread(target=self._start, name="mlflow-server-start",
                                       daemon=True)
        self.thread.start()

    def _start(self) -> None:
        try:
            self.server = start_mlflow_server(self.root / "server",
                                              timeout_s=_SHARED_WAIT_S)
            text = f"uri {self.server.uri}"
        except Exception as exc:  # told to every worker that needs the server
            text = "error " + " ".join(str(exc).split())[:2000]
        tmp = self.uri_file.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.uri_file)

    def stop(self) -> None:
        self.thread.join(_SHARED_WAIT_S)
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.root, ignore_errors=True)


_shared_mlflow = pytest.StashKey[_SharedMlflow]()


def _xdist_controller(config: pytest.Config) -> bool:
    """True in the pytest process that runs xdist workers (``-n N`` with N > 0)."""
    if hasattr(config, "workerinput"):
        return False
    workers = getattr(config.option, "numprocesses", None)
    dist = getattr(config.option, "dist", "no")
    return bool(workers) and dist != "no"


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, or a run without workers
        config.stash[_folders_before] = {
            folder: _entries(folder) for folder in {_REPO, Path.cwd().resolve()}}
    if _xdist_controller(config):
        config.stash[_shared_mlflow] = _SharedMlflow()


_left = pytest.StashKey[dict[Path, list[str]]]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The guard (module docstring): in the controller, after every worker has finished."""
    before = session.config.stash.get(_folders_before, None)
    if before is None:
        return
    left = session.config.stash[_left] = _left_behind(before)
    if left and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    for folder, names in config.stash.get(_left, {}).items():
        terminalreporter.write_sep("=", "files left in the work tree", red=True, bold=True)
        terminalreporter.write_line(
            f"the tests left {', '.join(names)} in {folder}: every test writes under its own "
            "tmp_path (run the test files one at a time to find which)", red=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist: each worker learns where the shared server's URI will be written."""
    shared = node.config.stash.get(_shared_mlflow, None)
    if shared is not None:
        node.workerinput[_SHARED_KEY] = str(shared.uri_file)


# -- xdist groups under pytest 9.2 -------------------------------------------------------------
# Tests that share one expensive launch (a module fixture) are an ``xdist_group``: under
# ``--dist loadgroup`` pytest-xdist sends a group to one worker, which then launches once.  xdist
# says which group a test is in by appending ``@<group>`` to its node id in the worker, through
# a field (``item._nodeid``) that pytest 9.2 no longer reads (node ids are structured now), so the
# groups were silently ignored and each worker given one of a group's tests launched the job
# again (pytest-dev/pytest-xdist#1386).  This writes the suffix where pytest reads it.


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):  # set in xdist's workers only
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # an older pytest: xdist's own suffix works there
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix) and isinstance(
                getattr(item, "_id", None), NodeId):
            item._id = NodeId.parse(item.nodeid + suffix)


def _shared_uri(path: Path) -> str:
    deadline = time.monotonic() + _SHARED_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise MlflowServerError(f"the shared MLflow server was not up within "
                                    f"{_SHARED_WAIT_S:.0f} s ({path} never written)")
        time.sleep(0.1)
    kind, _, text = path.read_text().partition(" ")
    if kind != "uri":
        raise MlflowServerError(f"the shared MLflow server did not start: {text}")
    return text


@pytest.fixture(scope="session")
def mlflow_server(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Tracking URI of a real MLflow server on 127.0.0.1, shared by the whole session (by
    every worker under pytest-xdist)."""
    workerinput = getattr(request.config, "workerinput", {})
    if _SHARED_KEY in workerinput:
        yield _shared_uri(Path(workerinput[_SHARED_KEY]))
        return
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
        mlflow.set_tracking_uri(None)  # None resets to the env var
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
