"""MLflow: rows as metrics with ``step=`` the training step, written by a background thread.

MLflow's active run is thread-local, so the run is found at ``open()`` (on the thread that
calls ``Monitor.start()``) and every write names its run id explicitly through
``MlflowClient.log_batch``.  Keys are made valid for MLflow (letters, digits, ``_ - . / `` and
space; anything else becomes ``_``).

What the run gets (:mod:`gpulens.sinks.layout` for the choice of keys):

* metrics: the tracker view (``keys="default"``: a handful of job-level figures in the loss's
  section, the loop's scalars, ``alerts/<rule>`` once fired) or every key of the schema
  (``keys="all"``);
* params ``gpulens.*`` at open: version, backend (``simulated`` said plainly), hostname,
  interval, the GPUs and the run's metadata (dtype, MFU peak and its source ...).  A param the
  run already holds with another value (a resumed run) is kept, and said at INFO;
* a tag per alert rule, ``gpulens.alert.<rule>``: ``"firing at step N: <what was seen> Try:
  <advice>"``, then ``"resolved at step M (fired at step N: ...)"``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import socket
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from gpulens.log import logger as _log
from gpulens.log import one_line, warn_once
from gpulens.model import Event, Outcome, Row, RunContext
from gpulens.sinks.layout import TrackerLayout, check_section, resolve_keys, run_metadata

_INVALID = re.compile(r"[^A-Za-z0-9_\-. /]")
_BATCH = 1000  # MLflow's limit of metrics per log_batch call
_PARAM_BATCH = 100  # ... and of params
_MAX_TEXT = 5000  # longest tag or param value written (MLflow's limits: 8000 and 6000)


def mlflow_key(key: str) -> str:
    """``key`` with characters MLflow rejects replaced by ``_``."""
    return _INVALID.sub("_", key)


def import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError as exc:
        raise ImportError("the 'mlflow' sink needs mlflow: pip install 'gpulens[mlflow]'") from exc
    return mlflow


class MlflowSink:
    """Logs rows to an MLflow run.

    Args:
        run_id: the run to log to.  Default: the run active at ``open()``, else the run of
            ``MLFLOW_RUN_ID`` (as MLflow's own fluent calls do), else a new run in
            the experiment of ``MLFLOW_EXPERIMENT_NAME``/``MLFLOW_EXPERIMENT_ID`` (MLflow's
            default experiment otherwise), ended at close.
        tracking_uri: default: MLflow's own setting (``MLFLOW_TRACKING_URI``, ...).
        include_train: also write the ``train/*`` scalars (off when the framework logs them).
        keys: ``"default"`` (the tracker view of :mod:`gpulens.sinks.layout`) or ``"all"``
            (every key of the row); ``None``: ``GPULENS_TRACKER_KEYS``, else default.
        section: the section of the default view's figures; ``None``: ``train`` for training
            rows when this sink writes ``train/*``, bare keys (MLflow's "Model metrics", where
            Hugging Face's ``MLflowCallback`` puts ``loss``) when the framework does.
    """

    def __init__(self, run_id: str | None = None, *, tracking_uri: str | None = None,
                 include_train: bool = True, keys: str | None = None,
                 section: str | None = None) -> None:
        if run_id is not None:
            check_run_id(run_id)
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.include_train = include_train
        self.keys = resolve_keys(keys)
        self.section = check_section(section)
        self._client: Any = None
        self._owned = False
        self._outcome: Outcome = "finished"
        self._layout = TrackerLayout(self.keys, section=self._section(),
                                     include_train=include_train)
        self._fired: dict[str, str] = {}

    def _section(self) -> str | None:
        if self.section is not None:
            return self.section
        return None if self.include_train else ""

    @staticmethod
    def spec_options(arg: str | None) -> dict[str, Any]:
        """``"mlflow"``, ``"mlflow:RUN_ID"``, ``"mlflow:all"`` or ``"mlflow:RUN_ID,all"``
        (``all``/``default``: the tracker key set)."""
        options: dict[str, Any] = {}
        for part in (arg or "").split(","):
            part = part.strip()
            if part.lower() in ("all", "default"):
                options["keys"] = part.lower()
            elif part:
                if "run_id" in options:
                    raise ValueError(f"the mlflow sink takes a run id and a key set ('all'), "
                                     f"got 'mlflow:{arg}'")
                options["run_id"] = part
        return options

    @staticmethod
    def check_options(options: dict[str, Any]) -> dict[str, Any]:
        """``ValueError`` (one line) for a run id MLflow would refuse (a tracking URI written
        where the run id goes, say), an unknown key set (also ``GPULENS_TRACKER_KEYS``'s) or
        section."""
        if options.get("run_id") is not None:
            check_run_id(options["run_id"])
        uri = options.get("tracking_uri")
        if uri is not None and (not isinstance(uri, str) or not uri.strip()):
            raise ValueError(f"the mlflow sink's tracking_uri must be text, got {uri!r}")
        resolve_keys(options.get("keys"))
        check_section(options.get("section"))
        return options

    @staticmethod
    def prepare_options(options: dict[str, Any]) -> dict[str, Any]:
        """At start, in the training process: the tracking URI it set
        (``mlflow.set_tracking_uri``) and the run it has active, which the engine process
        cannot see (read only where mlflow is imported already: otherwise there are none, and
        the engine finds ``MLFLOW_TRACKING_URI`` as this process does); then the cheap checks
        of :func:`check_tracking_store`."""
        uri, run_id = options.get("tracking_uri"), options.get("run_id")
        mlflow = sys.modules.get("mlflow")
        if mlflow is not None:
            if uri is None:
                uri = mlflow.get_tracking_uri()
            if run_id is None:
                active = mlflow.active_run()
                if active is not None:
                    run_id = active.info.run_id
        elif uri is None:
            uri = os.environ.get("MLFLOW_TRACKING_URI") or None
        if run_id is None:
            run_id = env_run_id()
        check_tracking_store(uri)
        return {**options, "tracking_uri": uri, "run_id": run_id}

    @classmethod
    def from_spec(cls, arg: str | None) -> MlflowSink:
        """The sink of ``"mlflow:..."``, built here."""
        return cls(**cls.check_options(cls.spec_options(arg)))

    def check(self) -> None:
        """The cheap checks of :func:`check_tracking_store` (mlflow installed; a server that
        accepts connections; a store MLflow writes, in a folder that can be written), before
        anything is created; ``ValueError`` (one line)."""
        self.prepare_options({"tracking_uri": self.tracking_uri, "run_id": self.run_id})

    def prepare(self) -> None:
        """At start, on the thread that starts the monitor (MLflow's active run is per
        thread; this sink opens on a thread of its own): the run active there and the tracking
        URI set there become this sink's, then :meth:`check`'s checks."""
        options = self.prepare_options({"tracking_uri": self.tracking_uri,
                                        "run_id": self.run_id})
        self.tracking_uri, self.run_id = options["tracking_uri"], options["run_id"]

    def open(self, context: RunContext) -> None:
        """Find or create the run and write its metadata (imports mlflow: seconds; a monitor
        opens its sinks off the training thread)."""
        mlflow = import_mlflow()
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri or mlflow.get_tracking_uri()
        # a database store's tables may be in the making by another process (the training
        # process's own first MLflow call on a new sqlite:/// file): MLflow's table creation
        # then fails here; a second try finds them made
        pauses = list(_DB_OPEN_PAUSES_S) if _is_database_store(uri) else []
        while True:
            try:
                self._client = MlflowClient(tracking_uri=uri)
                if self.run_id is None:
                    active = mlflow.active_run()
                    if active is not None:
                        self.run_id = active.info.run_id
                    elif env_run_id() is not None:
                        self.run_id = env_run_id()
                    else:
                        check_tracking_store(uri)  # a one-line error, not MLflow's retries
                        run = self._client.create_run(self._experiment_id(), tags={
                            "mlflow.source.name": "gpulens", "gpulens.host": context.hostname})
                        self.run_id = run.info.run_id
                        self._owned = True
                        _log.info("gpulens: no MLflow run was active at start(); rows go to "
                                  "a run of gpulens's own, %s (experiment %s), ended at stop",
                                  self.run_id, run.info.experiment_id)
                break
            except ValueError:
                raise
            except Exception as exc:
                if "MLFLOW_ALLOW_FILE_STORE" in str(exc):
                    raise ValueError(_file_store_refused(str(uri))) from None
                if not pauses:
                    raise
                _log.debug("gpulens: opening the MLflow store %s failed (%s); trying again",
                           uri, one_line(exc))
                time.sleep(pauses.pop(0))
        self._layout = TrackerLayout(self.keys, section=self._section(),
                                     include_train=self.include_train)
        self._fired = {}
        write_run_params(self._client, self.run_id, context)

    def _experiment_id(self) -> str:
        exp_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
        if exp_id:
            return exp_id
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name:
            exp = self._client.get_experiment_by_name(name)
            return str(exp.experiment_id) if exp is not None else str(
                self._client.create_experiment(name))
        return "0"

    def write(self, row: Row) -> None:
        """One ``log_batch`` call per row (per 1000 metrics), then the GIL is yielded.

        MLflow's client is Python through and through (about 20 ms of CPU a 100-metric row
        into a local SQLite store, measured here). Rows that wait go out through
        :meth:`write_rows`, up to 1000 metrics a call: from the engine process (the
        ``"mlflow"`` sink) that holds no GIL of the training process; a sink object passed
        to the monitor, or ``isolation="thread"``, writes in the training process, where
        such a call holds the GIL longer than a row's (not measured).
        """
        from mlflow.entities import RunTag

        metrics = self._metrics(row)
        tags = [RunTag(k, v) for k, v in alert_tags(row.events, self._fired).items()]
        for i in range(0, max(len(metrics), 1), _BATCH):
            batch = metrics[i:i + _BATCH]
            if not batch and not tags:
                break
            self._client.log_batch(self.run_id, metrics=batch, tags=tags[:100],
                                   synchronous=True)
            tags = tags[100:]
            time.sleep(0)
        if tags:
            self._client.log_batch(self.run_id, tags=tags, synchronous=True)

    def write_rows(self, rows: list[Row]) -> int:
        """Waiting rows (a backlog: fast steps, a tracker that was down) in one ``log_batch``
        call of at most 1000 metrics: the leading rows that fit, at least one (a row of its
        own above the limit goes through :meth:`write`).  Returns how many rows were written.

        A call costs about the same for one row as for a hundred (9 ms against 0.7 ms a row
        into a local SQLite store, ``log_batch`` of 9-metric rows), so a backlog drains
        ten times faster and ``stop()`` waits that much less."""
        metrics: list[Any] = []
        taken = 0
        for row in rows:
            mine = self._metrics(row)
            if taken and (len(metrics) + len(mine) > _BATCH or row.events):
                break  # the limit; or a row with events (tags): written on its own
            if not taken and (len(mine) > _BATCH or row.events):
                self.write(row)
                return 1
            metrics.extend(mine)
            taken += 1
        if metrics:
            self._client.log_batch(self.run_id, metrics=metrics, synchronous=True)
        return taken

    def _metrics(self, row: Row) -> list[Any]:
        from mlflow.entities import Metric

        ms = int(row.time * 1000)
        shown, _ = self._layout.split(row.values)
        return [Metric(mlflow_key(key), value, ms, row.step) for key, value in shown.items()]

    def end_run_as(self, outcome: Outcome) -> None:
        self._outcome = outcome

    def close(self) -> None:
        """Ends the run of gpulens's own (none was active at start) as training ended:
        ``FINISHED``, ``FAILED`` (it raised) or ``KILLED`` (interrupted); a user's run is left
        to the user."""
        if self._owned and self._client is not None and self.run_id is not None:
            # MLflow's RunStatus names: FINISHED, FAILED, KILLED
            self._client.set_terminated(self.run_id, status=self._outcome.upper())
        self._client = None


_DB_OPEN_PAUSES_S = (0.5, 1.0, 2.0)
"""Pauses between the tries to open a database store (:meth:`MlflowSink.open`)."""


def _is_database_store(uri: str | None) -> bool:
    """Whether ``uri`` names one of MLflow's SQLAlchemy stores (``sqlite:``, ``postgresql:``,
    ``mysql:``, ``mssql:``, with or without a ``+driver``)."""
    scheme = urllib.parse.urlparse(uri or "").scheme.lower().split("+", 1)[0]
    return scheme in ("sqlite", "postgresql", "mysql", "mssql")


def write_run_params(client: Any, run_id: str | None, context: RunContext) -> None:
    """The run's metadata as ``gpulens.*`` params (see the module doc) through an
    ``MlflowClient``; never a reason not to log rows: a failure is a warning, once; a param
    the run holds already with another value (a resumed run) is kept, and said at INFO. Also
    used for Lightning's ``MLFlowLogger`` (its client and run)."""
    from mlflow.entities import Param

    params = {mlflow_key(f"gpulens.{k}"): _text(v)
              for k, v in run_metadata(context).items()}
    try:
        existing: dict[str, str] = dict(client.get_run(run_id).data.params)
        new = {k: v for k, v in params.items() if k not in existing}
        kept = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
        items = [Param(k, v) for k, v in new.items()]
        for i in range(0, len(items), _PARAM_BATCH):
            client.log_batch(run_id, params=items[i:i + _PARAM_BATCH], synchronous=True)
    except Exception as exc:
        warn_once("mlflow-params", "gpulens: could not write the run's metadata (GPUs, "
                  "backend, ...) as MLflow params: %s", one_line(exc))
        return
    if kept:
        _log.info("gpulens: MLflow run %s already has %s with other values (a resumed "
                  "run?); they are kept", run_id, ", ".join(kept))


def alert_tags(events: tuple[Event, ...], fired: dict[str, str]) -> dict[str, str]:
    """``gpulens.alert.<rule>`` tags for the alert events of a row; ``fired``: the text of
    each rule firing now (kept here, for the tag of its end)."""
    tags: dict[str, str] = {}
    for event in events:
        if event.kind != "alert":
            continue
        if event.state == "firing":
            text = f"firing at step {event.step}: {event.message}".strip()
            if event.advice:
                text += f" Try: {event.advice}"
            fired[event.name] = text
        else:
            was = fired.pop(event.name, "")
            text = f"{event.state} at step {event.step}"
            if was:
                text += f" ({was.replace('firing at', 'fired at', 1)})"
        tags[mlflow_key(f"gpulens.alert.{event.name}")] = text[:_MAX_TEXT]
    return tags


def _text(value: object) -> str:
    """A param's value as MLflow keeps it (text, at most ``_MAX_TEXT`` characters)."""
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return text[:_MAX_TEXT]


_RUN_ID = re.compile(r"^[a-zA-Z0-9][\w\-]{0,255}$")
"""The run ids MLflow accepts."""
FILE_STORE_REFUSED = (3, 13)
"""The first MLflow that refuses a file store (``file:``, ``./mlruns``) unless
``MLFLOW_ALLOW_FILE_STORE`` is set."""


def env_run_id() -> str | None:
    """The run ``MLFLOW_RUN_ID`` names (set by ``mlflow run`` and by users: MLflow's fluent
    calls log into it with no ``start_run``), when it is a valid run id; else ``None``."""
    run_id = os.environ.get("MLFLOW_RUN_ID", "").strip()
    return run_id if _RUN_ID.match(run_id) else None


def check_run_id(run_id: object) -> None:
    """``ValueError`` (one line) for a run id MLflow would refuse, saying what was probably
    meant when it is a tracking URI."""
    if isinstance(run_id, str) and _RUN_ID.match(run_id):
        return
    if isinstance(run_id, str) and ("://" in run_id or run_id.startswith("file:")):
        raise ValueError(
            f"the mlflow sink: {run_id!r} is a tracking URI, not a run id; set "
            f"MLFLOW_TRACKING_URI={run_id} (or call mlflow.set_tracking_uri) and use 'mlflow'")
    raise ValueError(f"the mlflow sink: {run_id!r} is not an MLflow run id (letters, digits, "
                     "'_' and '-', as 'mlflow runs list' shows them)")


def check_tracking_store(uri: str | None) -> None:
    """``ValueError`` (one line) for a tracking store that cannot work, found cheaply (no
    import of mlflow, at most :data:`CONNECT_WAIT_S` of waiting):

    * mlflow is not installed;
    * an ``http(s)://`` server whose host:port refuses or cannot be reached (a TCP connection,
      not a request; one not answered within the wait is left to MLflow);
    * a file store (``file:``, a path) where the installed MLflow refuses one
      (:data:`FILE_STORE_REFUSED` on, unless ``MLFLOW_ALLOW_FILE_STORE``), or in a folder that
      cannot be written; a ``sqlite:///`` store in a folder that cannot be written.

    ``None`` (MLflow's own default store) and other schemes are left to MLflow."""
    if importlib.util.find_spec("mlflow") is None:
        raise ValueError("the 'mlflow' sink needs mlflow: pip install 'gpulens[mlflow]'")
    if uri is None:
        return
    parsed = urllib.parse.urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme in ("http", "https"):
        _check_reachable(uri, parsed)
        return
    if scheme == "file" or scheme == "" or len(scheme) == 1:  # a path (C:\... included)
        refused = _mlflow_version() >= FILE_STORE_REFUSED and os.environ.get(
            "MLFLOW_ALLOW_FILE_STORE", "").strip().lower() not in ("true", "1")
        if refused:
            raise ValueError(_file_store_refused(uri))
        if scheme == "file":
            from urllib.request import url2pathname  # here: ~10 ms to import, and rarely used

            folder = Path(url2pathname(parsed.path))
        else:
            folder = Path(uri)
    elif scheme == "sqlite":
        folder = Path(parsed.path[1:]).parent  # sqlite:///relative.db, sqlite:////abs.db
    else:
        return
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"the mlflow sink cannot write the MLflow store {uri}: "
                         f"{str(existing)!r} is not a writable folder")


def _file_store_refused(uri: str) -> str:
    return (f"the mlflow sink: MLflow {_mlflow_version_text()} refuses the file store {uri} "
            "(its filesystem backend is in maintenance mode); use a database store, e.g. "
            "MLFLOW_TRACKING_URI=sqlite:///mlflow.db (or set MLFLOW_ALLOW_FILE_STORE=true)")


def _mlflow_version_text() -> str:
    import importlib.metadata  # here: ~10 ms to import, and only a file store needs it

    try:
        return importlib.metadata.version("mlflow")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _mlflow_version() -> tuple[int, int]:
    """The installed MLflow's (major, minor), read from its metadata (no import)."""
    found = re.match(r"(\d+)\.(\d+)", _mlflow_version_text())
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


CONNECT_WAIT_S = 0.3
"""How long a check waits for a tracking server's host to take a TCP connection."""
_REACHED: dict[tuple[str, int], float] = {}
"""Servers found reachable (or not refused within the wait), and when: checked again only
after :data:`_REACHED_FOR_S` (an integration checks, then ``start()`` does)."""
_REACHED_FOR_S = 5.0


def _check_reachable(uri: str, parsed: urllib.parse.ParseResult) -> None:
    """``ValueError`` if nothing takes a TCP connection at the server's host:port; the
    connection is made in a thread of its own and waited for at most :data:`CONNECT_WAIT_S`
    (a name to resolve, a host that drops packets: left to MLflow, which says so)."""
    host = parsed.hostname or "localhost"
    try:
        port = parsed.port or (443 if parsed.scheme.lower() == "https" else 80)
    except ValueError as exc:
        raise ValueError(f"the mlflow sink: bad tracking URI {uri}: {exc}") from None
    now = time.monotonic()
    if now - _REACHED.get((host, port), -math.inf) < _REACHED_FOR_S:
        return
    outcome: list[OSError | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=10.0).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=connect, name="gpulens-mlflow-check", daemon=True)
    thread.start()
    thread.join(CONNECT_WAIT_S)
    failed = outcome[0] if outcome else None
    if failed is not None:
        reason = failed.strerror or failed
        raise ValueError(f"the mlflow sink cannot reach the MLflow tracking server at {uri} "
                         f"({reason}); start it, or point MLFLOW_TRACKING_URI at a server that "
                         "runs")
    _REACHED[(host, port)] = now
