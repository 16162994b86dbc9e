"""A real MLflow tracking server on 127.0.0.1 for tests.

``start_mlflow_server(root)`` runs the ``mlflow`` of the current interpreter's environment::

    python -m mlflow server --backend-store-uri sqlite:///<root>/mlflow.db
        --default-artifact-root <root>/artifacts --host 127.0.0.1 --port <free> --workers 1

in its own session (so its own process group: the CLI, the uvicorn worker and any helper they
spawn), waits until ``GET /health`` answers 200, and returns an ``MlflowServer`` whose
``stop()`` kills the whole process group and reaps it.

The group's leader is a small watchdog that runs the server and kills the group when the test
process that started it goes away without calling ``stop()`` (killed pytest, ``os._exit``), so
no server outlives its test session.

Notes for mlflow 3.17:
- Its security middleware checks the Host header; the default allows localhost and 127.0.0.1
  on any port, which is all the tests use, so no ``--allowed-hosts`` is passed.
- ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`` is set for the server: otherwise it starts a job
  runner and seven huey consumer processes, which cost seconds of start-up on two cores and are
  not needed for tracking.
- Telemetry is switched off (``MLFLOW_DISABLE_TELEMETRY``, ``DO_NOT_TRACK``): loopback only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STARTUP_TIMEOUT_S = 240.0  # bounds a hang; a loaded machine can take a minute
STOP_TIMEOUT_S = 10.0
_LOG_TAIL_CHARS = 4000


class MlflowServerError(RuntimeError):
    """The MLflow server did not come up; the message holds the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _log_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<no log: {exc}>"
    return text[-_LOG_TAIL_CHARS:]


@dataclass
class MlflowServer:
    """A running server: ``uri`` is the tracking URI (``http://127.0.0.1:<port>``)."""

    uri: str
    port: int
    root: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    file_store: bool = False
    _stopped: bool = field(default=False, repr=False)

    @property
    def backend_store_uri(self) -> str:
        return _store_uri(self.root, self.file_store)

    def is_healthy(self, timeout_s: float = 1.0) -> bool:
        """True when ``GET /health`` answers 200 within ``timeout_s`` seconds."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy
        try:
            with opener.open(f"{self.uri}/health", timeout=timeout_s) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self) -> str:
        """The last few thousand characters of the server's stdout and stderr."""
        return _log_tail(self.log_path)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S, *, kill: bool = False,
             sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop the whole process group: ``sig`` (SIGTERM), then SIGKILL after ``timeout_s``
        seconds; ``kill``: SIGKILL at once (gone as a crash leaves it, without uvicorn's
        graceful shutdown, which takes seconds).

        Idempotent. The group's leader is reaped; any process left in the group afterwards is
        killed too, so no uvicorn worker outlives the test session.
        """
        if self._stopped:
            return
        self._stopped = True
        pgid = self.process.pid  # start_new_session=True: the leader's pid is the group id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL if kill else sig)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.process.wait(timeout=timeout_s)
        # Workers may take a moment longer than the leader; give them the same grace.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)

    def kill(self) -> None:
        """The server dies: SIGKILL to the whole group at once (no graceful shutdown, which
        takes uvicorn a second or two); returns once the group is gone.  Idempotent."""
        self.stop(sig=signal.SIGKILL)


# The process-group leader: runs the command, passes on its exit code, and kills the whole
# group if the process that started it dies first (it is then reparented).
_WATCHDOG = """
import os, signal, subprocess, sys, time
starter = int(sys.argv[1])
child = subprocess.Popen(sys.argv[2:])
while child.poll() is None:
    if os.getppid() != starter:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
        try:
            child.wait(timeout=10)
        finally:
            os.killpg(0, signal.SIGKILL)
    time.sleep(0.5)
sys.exit(child.returncode)
"""


def _store_uri(root: Path, file_store: bool) -> str:
    return str(root / "mlruns") if file_store else f"sqlite:///{root / 'mlflow.db'}"


def _server_env(file_store: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    env["DO_NOT_TRACK"] = "true"
    if file_store:
        env["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 asks for it
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _start_once(root: Path, port: int, timeout_s: float, file_store: bool) -> MlflowServer:
    log_path = root / f"server-{port}.log"
    artifacts = root / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-c",
        _WATCHDOG,
        str(os.getpid()),
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        _store_uri(root, file_store),
        "--default-artifact-root",
        str(artifacts),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=root,
            env=_server_env(file_store),
            start_new_session=True,
        )
    server = MlflowServer(
        uri=f"http://127.0.0.1:{port}",
        port=port,
        root=root,
        log_path=log_path,
        process=process,
        file_store=file_store,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        if server.is_healthy():
            return server
        code = process.poll()
        if code is not None:
            server.stop()
            raise MlflowServerError(
                f"mlflow server exited with code {code} before /health answered; "
                f"log {log_path}:\n{server.log_tail()}"
            )
        if time.monotonic() > deadline:
            server.stop()
            raise MlflowServerError(
                f"mlflow server on port {port} did not answer /health within {timeout_s:.0f} s; "
                f"log {log_path}:\n{server.log_tail()}"
            )
        time.sleep(0.2)


def start_mlflow_server(
    root: Path, *, timeout_s: float = STARTUP_TIMEOUT_S, attempts: int = 3,
    file_store: bool = False,
) -> MlflowServer:
    """Start a server storing everything under ``root``; return once ``/health`` answers.

    A port taken between choosing it and binding it makes the server exit at once; that is
    retried on a new port up to ``attempts`` times. Raises ``MlflowServerError`` with the
    server's log when it exits or stays silent for ``timeout_s`` seconds.

    ``file_store``: runs in files under ``root / "mlruns"`` instead of SQLite (no schema
    migrations at start: about 5 s instead of 13 on two loaded cores).
    """
    root.mkdir(parents=True, exist_ok=True)
    last_error: MlflowServerError | None = None
    for _ in range(attempts):
        port = free_port()
        try:
            return _start_once(root, port, timeout_s, file_store)
        except MlflowServerError as exc:
            last_error = exc
            if "address already in use" not in str(exc).lower():
                raise
    assert last_error is not None
    raise last_error


@dataclass(frozen=True)
class MlflowTracking:
    """What ``mlflow_tracking`` set up: the server's URI and this test's experiment name."""

    uri: str
    experiment_name: str

    def client(self) -> Any:
        """An ``mlflow.MlflowClient`` for the server."""
        from mlflow import MlflowClient

        return MlflowClient(self.uri)

    def runs(self) -> list[Any]:
        """The runs of this test's experiment (``mlflow.entities.Run``), oldest first."""
        client = self.client()
        experiment = client.get_experiment_by_name(self.experiment_name)
        if experiment is None:
            return []
        runs = client.search_runs([experiment.experiment_id], order_by=["start_time ASC"])
        return list(runs)
