"""GPU telemetry in the trackers an Accelerate ``Accelerator`` started, on the user's own steps.

One line, after ``init_trackers``::

    from accelerate import Accelerator
    from gpulens.integrations.accelerate import attach

    accelerator = Accelerator(log_with=["wandb", "mlflow"])
    accelerator.init_trackers("my-project", config=cfg)
    attach(accelerator)                            # <- the one line
    for step, batch in enumerate(loader, start=1):
        ...
        accelerator.log({"loss": loss.item()}, step=step)
    accelerator.end_training()

How it fits Accelerate's own API: a tracker (:class:`GPUTracker`, a ``GeneralTracker``) is put
first in ``accelerator.trackers``, so ``accelerator.log(values, step=...)`` reaches it before the
others and ``end_training()`` finishes it first, while the other runs are still open.

* Each ``accelerator.log`` ends the GPU window at ``step`` (the user's step; without ``step=``,
  the count of earlier ``log`` calls, as W&B numbers them).  The first call starts the first
  window (it carries no GPU row), so a resumed run's first row counts only the steps it ran;
  ``start_step=`` starts the window at ``attach`` instead.  Several calls at one step
  (training, then evaluation) end one window.
* Rows go into the runs the trackers started, on the user's steps: W&B through
  :class:`gpulens.sinks.wandb.WandbSink` on the tracker's run, written from gpulens's engine
  process (each row joins the user's pending step, plotted against ``gpulens/step``, the
  user's step; W&B's step is never pushed ahead of the user's ``step=``), MLflow through
  :class:`gpulens.sinks.mlflow.MlflowSink` on the tracker's run id with ``step=`` the user's
  step (written from gpulens's engine process),
  any other tracker through its own ``log(values, step=...)`` on the training thread.
* The values the user logs go to those trackers from Accelerate itself; gpulens adds only its
  own keys (``gpu/*``, ``host/*``, ``perf/*``).  Extra ``sinks`` (``"jsonl:PATH"``, ...) get
  full rows, the user's numbers as ``train/<name>``.
* ``accelerator.log`` runs on the main process only, so only the main process monitors; in a
  job of several processes on one node it watches every GPU it can see (``gpus=None``).  GPUs
  of other nodes are not watched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpulens.integrations.session import GateAction, StepGate
from gpulens.log import logger as _log
from gpulens.model import Row, RunContext
from gpulens.monitor import Monitor
from gpulens.sinks import SinkSpec, check_sinks, sink_spec
from gpulens.sinks.base import Sink
from gpulens.transport.spawn import prepare_engine

try:
    from accelerate.tracking import GeneralTracker
except ImportError as exc:  # pragma: no cover - exercised only without accelerate
    raise ImportError(
        "gpulens.integrations.accelerate needs Hugging Face accelerate: "
        "pip install 'gpulens[accelerate]'"
    ) from exc

__all__ = ["GPUTracker", "TrackerSink", "attach"]

OWN_PREFIXES = ("gpu/", "host/", "perf/")


def _own(values: dict[str, float]) -> dict[str, float]:
    """gpulens's own keys of a row (not the user's numbers, which the tracker has already)."""
    return {k: v for k, v in values.items() if k.startswith(OWN_PREFIXES)}


class TrackerSink:
    """Writes gpulens's own keys of each row to an Accelerate tracker with
    ``tracker.log(values, step=row.step)``, on the training thread (trackers are not
    thread-safe), for trackers gpulens has no sink of its own for (TensorBoard, ...)."""

    on_training_thread = True

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker

    def open(self, context: RunContext) -> None:
        pass

    def write(self, row: Row) -> None:
        self.tracker.log(_own(row.values), step=row.step)

    def close(self) -> None:
        pass


def _train_scalars(values: dict[str, Any]) -> dict[str, float]:
    """The user's numbers as ``train/<name>`` (for extra sinks: the trackers have them)."""
    out: dict[str, float] = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[name if name.startswith("train/") else f"train/{name}"] = float(value)
    return out


class GPUTracker(GeneralTracker):  # type: ignore[misc,unused-ignore]
    """The tracker :func:`attach` puts first in ``accelerator.trackers`` (see the module
    docstring).  ``tracker`` is the :class:`gpulens.Monitor`."""

    name = "gpulens"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, monitor: Monitor, start_step: int | None = None) -> None:
        super().__init__()
        self.monitor = monitor
        self._gate = StepGate()
        self._calls = 0
        self.finished = False
        """``finish()`` ran (``end_training``): a later ``attach`` replaces this tracker."""
        self.covers: list[Any] = []
        """The trackers of the run this one writes into (set by :func:`attach`)."""
        if start_step is not None:
            monitor.start(step=start_step)
        elif not monitor.running:  # it starts at the first log(): spawn its engine now
            prepare_engine(monitor.settings)

    @property
    def tracker(self) -> Monitor:
        return self.monitor

    def start(self) -> None:
        """Nothing to start: the window starts at the first ``log`` (or at ``attach``)."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """The configuration is the other trackers' business."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """End the GPU window at ``step`` (the first call starts it) and write the rows
        finished so far to the trackers."""
        self._calls += 1
        # without step= W&B numbers the calls from 0: the GPU row goes where its call's values went
        step = self._calls - 1 if step is None else int(step)
        monitor = self.monitor
        action = self._gate.at(step, started=monitor.running)
        if action is GateAction.START:
            monitor.start(step=step)
        elif action is GateAction.ROW:
            monitor.log(step, **_train_scalars(values))

    def finish(self) -> None:
        """Write every row still waiting into the trackers' runs (before they are ended)."""
        self.finished = True
        if self.monitor.running:
            self.monitor.stop()


def attach(accelerator: Any, *, sinks: Sequence[str | Sink] = (), interval: float = 0.5,
           gpus: Sequence[int] | None = None, backend: str | None = None,
           start_step: int | None = None) -> GPUTracker | None:
    """Write GPU rows into the trackers ``accelerator`` started (see the module docstring).

    Call it after ``accelerator.init_trackers(...)``, on every process (it does something only
    on the main process, where ``accelerator.log`` runs; elsewhere it returns ``None``).

    Args:
        accelerator: an ``accelerate.Accelerator`` whose trackers have started.
        sinks: extra sinks (``"jsonl:PATH"``, ``"prometheus:PORT"``, objects) with full rows.
        interval: seconds between the sampler's cheap reads.
        gpus: CUDA device numbers to watch; ``None``: every GPU this process sees.
        backend: ``"nvml"``, ``"simulated"`` or ``None`` (automatic, honours
            ``GPULENS_BACKEND``).
        start_step: start the first window now, after this step; ``None``: at the first
            ``accelerator.log``.

    Returns the :class:`GPUTracker` (its ``monitor`` is the :class:`gpulens.Monitor`).
    Raises ``ValueError`` (one line) for bad arguments, when no tracker has started and no
    sink is given, or when a tracker's run cannot be reached (the sinks' ``check()``).
    """
    if not getattr(accelerator, "is_main_process", True):
        return None
    trackers = list(getattr(accelerator, "trackers", None) or ())
    earlier = [t for t in trackers if isinstance(t, GPUTracker)]
    if any(not t.finished for t in earlier):
        raise ValueError("gpulens is already attached to this Accelerator")
    # a second run on one Accelerator (end_training, then init_trackers again): Accelerate keeps
    # the finished run's trackers in its list; leave them and their GPUTracker out
    ended = {id(c) for t in earlier for c in t.covers}
    for t in earlier:
        accelerator.trackers.remove(t)
    trackers = [t for t in trackers if not isinstance(t, GPUTracker) and id(t) not in ended]
    if not trackers and not sinks:
        raise ValueError("no tracker has started: call attach(accelerator) after "
                         "accelerator.init_trackers(...), or pass sinks=")
    own: list[str | SinkSpec | Sink] = []
    for tracker in trackers:
        own.append(_sink_for(tracker))
    if gpus is None and int(getattr(accelerator, "num_processes", 1)) > 1:
        gpus = _local_gpus()
    monitor = Monitor(gpus=gpus, interval=interval, sinks=[*own, *sinks], backend=backend,
                      distributed=False)
    check_sinks(monitor.sinks)
    gpu_tracker = GPUTracker(monitor, start_step=start_step)
    gpu_tracker.covers = trackers
    accelerator.trackers.insert(0, gpu_tracker)
    return gpu_tracker


def _sink_for(tracker: Any) -> SinkSpec | Sink:
    name = getattr(tracker, "name", "")
    if name == "wandb":
        return sink_spec("wandb", run=tracker.tracker, include_train=False)
    if name == "mlflow":
        import mlflow

        run = tracker.tracker
        return sink_spec("mlflow", run_id=run.info.run_id,
                         tracking_uri=mlflow.get_tracking_uri(), include_train=False)
    _log.info("gpulens: GPU rows go to Accelerate's %r tracker through its log()", name)
    return TrackerSink(tracker)


def _local_gpus() -> list[int] | None:
    """Every CUDA device this process sees (the main process watches the node's GPUs)."""
    try:
        import torch
    except ImportError:
        return None
    count = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    return list(range(count)) or None
