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

import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from gpulens.log import logger as _log
from gpulens.log import warn_once
from gpulens.model import Event, Row, RunContext
from gpulens.sinks.layout import TrackerLayout, check_section, resolve_keys, run_metadata

_INVALID = re.compile(r"[^A-Za-z0-9_\-. /]")
_BATCH = 1000  # MLflow's limit of metrics per log_batch call
_PARAM_BATCH = 100  # ... and of params
_MAX_TEXT = 5000  # longest tag or param value written (MLflow's limits: 8000 and 6000)
CHECK_TIMEOUT_S = 3.0
"""How long :meth:`MlflowSink.check` waits for a tracking server to answer."""


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
        run_id: the run to log to.  Default: the run active at ``open()``, else a new run in
            the experiment of ``MLFLOW_EXPERIMENT_NAME``/``MLFLOW_EXPERIMENT_ID`` (MLflow's
            default experiment otherwise), ended at close.
        tracking_uri: default: MLflow's own setting (``MLFLOW_TRACKING_URI``, ...).
        include_train: also write the ``train/*`` scalars (off when the framework logs them).
        keys: ``"default"`` (the tracker view of :mod:`gpulens.sinks.layout`) or ``"all"``
            (every key of the row); ``None``: ``GPULENS_TRACKER_KEYS``, else default.
        section: the section of the default view's figures; ``None``: ``train`` for training
            rows when this sink writes ``train/*``, bare keys (MLflow's "Model metrics", where
            Hugging Face's ``MLflowCallback`` puts ``loss``) when the framework does.
        fail_fast: give up on an HTTP request after 2 retries (back-off factor 1) and 15 s
            (unless the user set
            ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / ``MLFLOW_HTTP_REQUEST_TIMEOUT``): MLflow's
            own defaults (7 retries, 120 s each) keep a write to a server that went away busy
            for minutes, so nobody hears of it.  gpulens retries the row itself, with its own
            back-off, and says so.  Set for the copy rebuilt in gpulens's engine process, whose
            environment is gpulens's own; never in the training process.
    """

    def __init__(self, run_id: str | None = None, *, tracking_uri: str | None = None,
                 include_train: bool = True, fail_fast: bool = False,
                 keys: str | None = None, section: str | None = None) -> None:
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.include_train = include_train
        self.fail_fast = fail_fast
        self.keys = resolve_keys(keys)
        self.section = check_section(section)
        self._client: Any = None
        self._owned = False
        self._layout = TrackerLayout(self.keys, section=self._section(),
                                     include_train=include_train)
        self._fired: dict[str, str] = {}

    def _section(self) -> str | None:
        if self.section is not None:
            return self.section
        return None if self.include_train else ""

    @classmethod
    def from_spec(cls, arg: str | None) -> MlflowSink:
        """``"mlflow"``, ``"mlflow:RUN_ID"``, ``"mlflow:all"`` or ``"mlflow:RUN_ID,all"``
        (``all``/``default``: the tracker key set)."""
        run_id: str | None = None
        keys: str | None = None
        for part in (arg or "").split(","):
            part = part.strip()
            if part.lower() in ("all", "default"):
                keys = part.lower()
            elif part:
                if run_id is not None:
                    raise ValueError(f"the mlflow sink takes a run id and a key set ('all'), "
                                     f"got 'mlflow:{arg}'")
                run_id = part
        return cls(run_id=run_id, keys=keys)

    def check(self) -> None:
        """``ValueError`` (one line), before anything is created, if the tracking store cannot
        be reached: mlflow not installed; an ``http(s)://`` tracking server that does not answer
        within ``CHECK_TIMEOUT_S`` (any HTTP answer counts, even an error status: only a
        connection that fails means unreachable); a local store (``sqlite:///``, a path, or
        ``file:``) in a folder that cannot be written.  Other schemes (``databricks``, ...)
        are left to MLflow."""
        try:
            mlflow = import_mlflow()
        except ImportError as exc:
            raise ValueError(str(exc)) from None
        uri = self.tracking_uri or mlflow.get_tracking_uri()
        check_tracking_uri(str(uri))

    def remote_spec(self) -> tuple[str, dict[str, Any]]:
        """How the engine process rebuilds this sink, writing to the same run.

        The run active here and the tracking URI set here (``mlflow.set_tracking_uri``) are
        resolved now, in this process: the other process cannot see them.
        """
        run_id, uri = self.run_id, self.tracking_uri
        mlflow = sys.modules.get("mlflow")
        if mlflow is not None:
            if uri is None:
                uri = mlflow.get_tracking_uri()
            if run_id is None:
                active = mlflow.active_run()
                if active is not None:
                    run_id = self.run_id = active.info.run_id
        return "gpulens.sinks.mlflow:MlflowSink", {
            "run_id": run_id, "tracking_uri": uri, "include_train": self.include_train,
            "fail_fast": True, "keys": self.keys, "section": self.section}

    def open(self, context: RunContext) -> None:
        if self.fail_fast:
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        mlflow = import_mlflow()
        if self.run_id is None and mlflow.active_run() is None:
            self.check()  # before a run is made: a one-line error, not MLflow's retries
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri or mlflow.get_tracking_uri()
        self._client = MlflowClient(tracking_uri=uri)
        if self.run_id is None:
            active = mlflow.active_run()
            if active is not None:
                self.run_id = active.info.run_id
            else:
                run = self._client.create_run(self._experiment_id(), tags={
                    "mlflow.source.name": "gpulens", "gpulens.host": context.hostname})
                self.run_id = run.info.run_id
                self._owned = True
        self._layout = TrackerLayout(self.keys, section=self._section(),
                                     include_train=self.include_train)
        self._fired = {}
        self._write_params(context)

    def _write_params(self, context: RunContext) -> None:
        """The run's metadata as ``gpulens.*`` params (see the module doc); never a reason not
        to log rows: a failure is a warning, once; a param the run holds already with another
        value (a resumed run) is kept, and said at INFO."""
        from mlflow.entities import Param

        params = {mlflow_key(f"gpulens.{k}"): _text(v)
                  for k, v in run_metadata(context).items()}
        try:
            existing: dict[str, str] = dict(self._client.get_run(self.run_id).data.params)
            new = {k: v for k, v in params.items() if k not in existing}
            kept = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
            items = [Param(k, v) for k, v in new.items()]
            for i in range(0, len(items), _PARAM_BATCH):
                self._client.log_batch(self.run_id, params=items[i:i + _PARAM_BATCH],
                                       synchronous=True)
        except Exception as exc:
            warn_once("mlflow-params", "gpulens: could not write the run's metadata (GPUs, "
                      "backend, ...) as MLflow params: %s", _one_line(exc))
            return
        if kept:
            _log.info("gpulens: MLflow run %s already has %s with other values (a resumed "
                      "run?); they are kept", self.run_id, ", ".join(kept))

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
        into a local SQLite store, measured here): a burst written in one go would hold the
        GIL long enough to slow the training thread, so rows go one call at a time with a
        yield between them.
        """
        from mlflow.entities import Metric, RunTag

        ms = int(row.time * 1000)
        shown, _ = self._layout.split(row.values)
        metrics = [Metric(mlflow_key(key), value, ms, row.step) for key, value in shown.items()]
        tags = [RunTag(k, v) for k, v in self._alert_tags(row.events).items()]
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

    def _alert_tags(self, events: tuple[Event, ...]) -> dict[str, str]:
        """``gpulens.alert.<rule>`` tags for the alert events of a row."""
        tags: dict[str, str] = {}
        for event in events:
            if event.kind != "alert":
                continue
            if event.state == "firing":
                text = f"firing at step {event.step}: {event.message}".strip()
                if event.advice:
                    text += f" Try: {event.advice}"
                self._fired[event.name] = text
            else:
                fired = self._fired.pop(event.name, "")
                text = f"{event.state} at step {event.step}"
                if fired:
                    text += f" ({fired.replace('firing at', 'fired at', 1)})"
            tags[mlflow_key(f"gpulens.alert.{event.name}")] = text[:_MAX_TEXT]
        return tags

    def close(self) -> None:
        if self._owned and self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id)
        self._client = None


def _text(value: object) -> str:
    """A param's value as MLflow keeps it (text, at most ``_MAX_TEXT`` characters)."""
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return text[:_MAX_TEXT]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def check_tracking_uri(uri: str) -> None:
    """``ValueError`` (one line) if the MLflow tracking store at ``uri`` cannot be reached or
    written (see :meth:`MlflowSink.check`)."""
    parsed = urllib.parse.urlparse(uri)
    scheme = parsed.scheme.lower()
    hint = "start it, or point MLFLOW_TRACKING_URI at a server that runs"
    if scheme in ("http", "https"):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=CHECK_TIMEOUT_S):
                pass
        except urllib.error.HTTPError:
            return  # it answered
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ValueError(f"the mlflow sink cannot reach the MLflow tracking server at "
                             f"{uri} ({reason}); {hint}") from None
        return
    if scheme in ("sqlite", "file", ""):
        if scheme == "sqlite":
            # sqlite:///relative.db, sqlite:////absolute.db
            folder = Path(parsed.path[1:]).parent
        elif scheme == "file":
            folder = Path(urllib.request.url2pathname(parsed.path))
        else:
            folder = Path(uri)
        existing = folder
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"the mlflow sink cannot write the MLflow store {uri}: "
                             f"{str(existing)!r} is not a writable folder")
