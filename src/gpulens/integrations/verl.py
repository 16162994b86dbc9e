"""GPU rows beside a trainer's own tracking calls, verl style.

Trainers such as verl's ``RayPPOTrainer`` log once per step through their own tracking object::

    logger.log(data=metrics, step=global_step)   # -> wandb.log(data, step=step), mlflow, console

:class:`MergingLogger` wraps that object: each ``log`` ends the GPU window of ``step`` and goes
on to the wrapped logger at once, untouched; the GPU row of that step follows as a call of its
own, ``logger.log(gpu_row, step=step)``, as soon as it is finished and seen::

    from gpulens.integrations.verl import MergingLogger

    logger = MergingLogger.from_config(Tracking(...), config)   # off unless the config says so
    for step in ...:
        logger.log(data=metrics, step=step)
    # close() is optional: rows still waiting go out when the logger is dropped or at exit

Rows and calls, in order:

* The trainer's call is forwarded at once, unless a GPU row of an *earlier* step is still on
  its way: trackers that take ``step=`` (W&B) drop a call for a step below their current one,
  so the earlier row goes first.  Rows are finished a little after their step ends (up to about
  ``max(1 s, interval) + 0.2 s``) and are seen at the next ``log`` call; with verl's steps of
  many seconds each row goes out at the next call, before the next step's metrics, and nothing
  waits.  With steps shorter than that, a call waits (at most ``max_delay_s``) for the row
  before it; a row that does not come in time is given up on (``rows_missing``).
* Both calls of one step reach W&B with the same ``step=`` (one record), MLflow with the same
  step.  Several calls for one step (verl's SFT trainer logs training, then validation, at
  the same step) end one GPU window: only the first ends it, the others pass straight through.
* Nothing is lost when the trainer never calls :meth:`MergingLogger.close`: the rows still
  waiting are written when the ``MergingLogger`` is garbage-collected (verl's ``fit()`` keeps
  its logger in a local variable, dropped when ``fit()`` returns) or, at the latest, at
  interpreter exit (an ``atexit`` hook registered after ``wandb.init`` and the monitor's
  start, so it runs before W&B's and the monitor's own exit hooks).  An exception in
  ``fit()`` keeps the logger alive in its traceback until exit; the rows are written then.
* The first window starts at the first ``log`` call (that call carries no GPU row), so a
  resumed run's first row counts only the steps it ran; pass ``start_step`` to start the
  window when the ``MergingLogger`` is made instead (the step the run resumes from).
* GPU keys go only to the backends named in ``gpu_backends``.  Default: every backend of a
  verl ``Tracking`` (its ``logger`` dict) except ``"console"``, through ``Tracking.log``'s
  ``backend=`` argument; a tracking object without backends (an Accelerate ``Accelerator``,
  your own) gets the GPU calls itself.

In verl the training loop runs in the driver process, which sees every GPU of its node, so the
driver's monitor (``gpus=None``) watches the node's GPUs while Ray workers train on them.

In a ``torchrun`` job (verl's SFT trainer makes its ``Tracking`` on the logging rank only) every
rank must watch its own GPU and log the same steps: make the ``MergingLogger`` on every rank,
with ``None`` for the tracking object where the rank has none (its calls go nowhere; rank 0's
rows hold every rank's GPU)::

    logger = MergingLogger.from_config(Tracking(...) if is_logging else None, config)

Made on rank 0 alone, its first ``log`` waits for the other ranks' monitors (120 s, with a
WARNING), then goes on watching rank 0's GPU only.
"""

from __future__ import annotations

import atexit
import inspect
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpulens.finalizers import drop_exit_finalizer, exit_finalizer, exit_outcome
from gpulens.integrations.session import GateAction, StepGate
from gpulens.log import logger as _log
from gpulens.model import Outcome, Row, RunContext
from gpulens.schema import STEP_KEY
from gpulens.sinks import check_sinks
from gpulens.sinks.base import Sink
from gpulens.sinks.layout import TrackerLayout
from gpulens.transport.spawn import prepare_engine

__all__ = ["MergingLogger", "RowHandoff", "TrackingLogger"]

CONSOLE = "console"


class TrackingLogger(Protocol):
    """What :class:`MergingLogger` wraps: verl's ``Tracking`` (``log(data, step, backend=None)``),
    Accelerate's ``Accelerator`` (``log(values, step=None)``) and anything alike."""

    def log(self, data: dict[str, Any], step: int) -> None: ...


class RowHandoff:
    """A sink that keeps finished rows for the training loop to pick up with :meth:`take`.

    Written on the training thread (inside ``Monitor.log``/``stop``), so no lock is needed.
    A row is kept as the trackers' view of it (:class:`~gpulens.sinks.layout.TrackerLayout`,
    as the ``"wandb"`` and ``"mlflow"`` sinks write it): with ``keys="default"`` about ten
    job-level GPU figures in the ``train/`` section (``train/gpu_sm_active_pct_mean``,
    ``train/mfu_pct`` ...) and ``alerts/<rule>`` once that rule has fired; the per-GPU detail
    (``gpu/{i}/*``, ``gpu/all/*``, ``host/*``, ``perf/*``) is left to the JSONL record and
    Prometheus (verl's ``Tracking`` cannot hide keys, and ``perf/*`` is a section of verl's
    own).  ``keys="all"``: every key under the schema's names.  ``None``:
    ``GPULENS_TRACKER_KEYS``, else ``"default"``.  ``train/*`` keys are dropped by default:
    the trainer logs its own scalars.
    """

    on_training_thread = True

    def __init__(self, *, include_train: bool = False, keys: str | None = None) -> None:
        self.include_train = include_train
        self._layout = TrackerLayout(keys, include_train=include_train)
        self._rows: dict[int, dict[str, float]] = {}

    def open(self, context: RunContext) -> None:
        self._layout.reset()

    def write(self, row: Row) -> None:
        shown, _detail = self._layout.split(row.values)
        self._rows[row.step] = {k: v for k, v in shown.items() if k != STEP_KEY}

    def close(self) -> None:
        pass

    def take(self, step: int) -> dict[str, float] | None:
        """The row of ``step`` (removed), or ``None`` if it has not been finished yet."""
        return self._rows.pop(step, None)

    def discard_through(self, step: int) -> None:
        """Forget rows of steps up to ``step`` (they can no longer be merged anywhere)."""
        for s in [s for s in self._rows if s <= step]:
            del self._rows[s]


@dataclass
class _Call:
    step: int
    data: dict[str, Any] | None = None
    """The trainer's own call; ``None`` for the GPU row of ``step`` (a placeholder until then)."""
    since: float = field(default_factory=time.monotonic)


class _State:
    """What the finalizer needs: everything but the :class:`MergingLogger` itself."""

    def __init__(self, logger: Any, monitor: Any, handoff: RowHandoff | None,
                 gpu_backends: list[str] | None, rest_backends: list[str] | None,
                 max_delay_s: float) -> None:
        if monitor is not None and not monitor.running:
            check_sinks(monitor.sinks)  # a one-line error before any sink opens
        self.logger = logger
        self.monitor = monitor
        self.handoff = handoff
        self.gpu_backends = gpu_backends
        self.rest_backends = rest_backends
        self.max_delay_s = max_delay_s
        self.queue: deque[_Call] = deque()
        self.rows_missing = 0
        self.closed = False

    def send(self, data: dict[str, Any], step: int, backends: list[str] | None) -> None:
        if self.logger is None:
            return
        if backends is None:
            self.logger.log(data, step=step)
        elif backends:
            self.logger.log(data, step=step, backend=backends)

    def forward(self, call: _Call) -> None:
        """A call of the trainer's own: to every backend, as if unwrapped."""
        assert call.data is not None
        if self.logger is not None:
            self.logger.log(call.data, step=call.step)

    def pump(self, *, final: bool = False) -> None:
        """Forward what can go, in order (see the module docstring)."""
        now = time.monotonic()
        handoff = self.handoff
        while self.queue:
            head = self.queue[0]
            if head.data is not None:
                self.queue.popleft()
                self.forward(head)
                continue
            row = handoff.take(head.step) if handoff is not None else None
            if row is None and not final and now - head.since < self.max_delay_s:
                return  # its row is on its way: later calls wait behind it
            self.queue.popleft()
            if row is None:
                self.rows_missing += 1
                _log.debug("gpulens: the GPU row of step %d did not come", head.step)
            elif self.gpu_backends is None or self.gpu_backends:
                self.send(row, head.step, self.gpu_backends)
            if handoff is not None:
                handoff.discard_through(head.step)

    def finish(self, outcome: Outcome = "finished") -> None:
        """Stop the monitor (every row is finished) and forward everything still waiting."""
        if self.closed:
            return
        self.closed = True
        if self.monitor is not None and self.monitor.running:
            self.monitor.stop(outcome=outcome)
        self.pump(final=True)


def _finish_quietly(state: _State) -> None:
    """At garbage collection or interpreter exit: write what waits, never raise."""
    try:
        state.finish(exit_outcome())
    except Exception as exc:
        _log.warning("gpulens: writing the last GPU rows to the tracking logger failed: %r", exc)


class MergingLogger:
    """Wraps a tracking logger: each ``log(data, step)`` reaches it unchanged, and the GPU row
    of that step follows as a call of its own (see the module docstring).

    Args:
        logger: the trainer's tracking object (``log(data, step)``); ``None`` on a rank
            of a ``torchrun`` job that has none (the monitor runs, nothing is forwarded).
        monitor: a :class:`gpulens.Monitor` whose sinks include ``handoff`` (started here when
            it is not running: at the first ``log`` call, or now with ``start_step``); ``None``:
            calls pass straight through.
        handoff: the :class:`RowHandoff` given to ``monitor``.
        max_delay_s: the longest a call waits for the GPU row of an earlier step.
        start_step: start the first GPU window now, after this step (a resumed run passes the
            step it resumes from); ``None``: at the first ``log`` call.
        gpu_backends: the backends of a verl ``Tracking`` that get the GPU keys; ``None``:
            every backend but ``"console"``.  Ignored for a logger without backends.

    Attributes:
        rows_missing: GPU rows given up on (they did not come within ``max_delay_s``).
    """

    def __init__(self, logger: TrackingLogger | None, monitor: Any,
                 handoff: RowHandoff | None = None, *, max_delay_s: float = 10.0,
                 start_step: int | None = None, gpu_backends: Sequence[str] | None = None) -> None:
        if monitor is not None and (handoff is None or not _has_sink(monitor, handoff)):
            raise ValueError("MergingLogger: pass the RowHandoff that is among the monitor's "
                             "sinks (or build both with MergingLogger.from_config)")
        if not max_delay_s > 0:
            raise ValueError(f"max_delay_s must be > 0 seconds, got {max_delay_s!r}")
        if start_step is not None and (isinstance(start_step, bool)
                                       or not isinstance(start_step, int)):
            raise ValueError(f"start_step must be a whole number, got {start_step!r}")
        if monitor is not None and not monitor.running:
            check_sinks(monitor.sinks)  # a one-line error before any sink opens
        self.logger = logger
        self.monitor = monitor
        self.handoff = handoff
        self.max_delay_s = float(max_delay_s)
        gpu, rest = _split_backends(logger, gpu_backends)
        for kind, name in (("wandb", "W&B"), ("mlflow", "MLflow")):
            # wandb: two writers of one W&B run, the sink's records move W&B's step past calls
            # this logger still holds, and W&B drops them (the trainer's own values); mlflow:
            # the sink attaches to the trainer's active run, which then holds every GPU figure
            # twice, as the logger's raw keys and as the sink's tracker view
            if monitor is not None and gpu and kind in gpu and any(
                    getattr(s, "kind", None) == kind for s in monitor.sinks):
                raise ValueError(f"the monitor has a '{kind}' sink, but the GPU rows already go "
                                 f"to {name} through the logger's '{kind}' backend: leave "
                                 f"'{kind}' out of the sinks (trainer.gpu_monitor_sinks)")
        self._state = _State(logger, monitor, handoff, gpu, rest, self.max_delay_s)
        self._gate = StepGate()
        self._window_open = monitor is not None and monitor.running
        if monitor is not None and start_step is not None and not monitor.running:
            monitor.start(step=start_step)
            self._window_open = True
        elif monitor is not None and not monitor.running:
            # it starts at the first log(), in the middle of training: its engine process
            # is spawned now, while the trainer sets up
            prepare_engine(getattr(monitor, "settings", None))
        self._finalizer = self._make_finalizer()

    def _make_finalizer(self) -> weakref.finalize[Any, Any]:
        """Write what waits when this logger is garbage-collected, or at interpreter exit.

        The exit hook is registered with ``atexit`` here, after ``wandb.init`` (made with the
        tracking object, before this logger) and after the monitor started: ``atexit`` runs
        the newest hook first, so the rows go out while W&B's service and the monitor still
        run (``weakref.finalize``'s own exit hook may have been registered long before)."""
        return exit_finalizer(self, _finish_quietly, self._state)

    def _renew_finalizer(self) -> None:
        drop_exit_finalizer(self._finalizer)
        self._finalizer = self._make_finalizer()

    @property
    def rows_missing(self) -> int:
        return self._state.rows_missing

    @classmethod
    def from_config(cls, logger: TrackingLogger | None, cfg: Any, *,
                    sinks: Sequence[str | Sink] = (), max_delay_s: float = 10.0,
                    start_step: int | None = None,
                    gpu_backends: Sequence[str] | None = None) -> MergingLogger:
        """Wrap ``logger``; GPU monitoring as :func:`gpulens.from_config` reads it from ``cfg``
        (off: calls pass straight through)."""
        from gpulens.integrations.hydra import from_config

        handoff = RowHandoff()
        monitor = from_config(cfg, sinks=[handoff, *sinks])
        return cls(logger, monitor, handoff if monitor is not None else None,
                   max_delay_s=max_delay_s, start_step=start_step, gpu_backends=gpu_backends)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """Forward ``data`` at ``step`` to the wrapped logger, and end the GPU window at ``step``
        (the first call for a step only; the first call of all starts the window).

        In a ``torchrun`` job call it on every rank, for the same steps (module docstring)."""
        state = self._state
        step = int(step)
        call = _Call(step, dict(data))
        monitor = self.monitor
        if monitor is None or state.closed:
            state.forward(call)
            return
        placeholder: _Call | None = None
        action = self._gate.at(step, started=self._window_open)
        if action is GateAction.START:
            monitor.start(step=step)  # the first window starts here, after this step
            self._window_open = True
            self._renew_finalizer()  # its exit hook now comes after the monitor's
        elif action is GateAction.ROW:
            monitor.log(step)
            placeholder = _Call(step)
        # the call goes before any waiting row of its own step or a later one
        index = len(state.queue)
        while index > 0 and state.queue[index - 1].data is None \
                and state.queue[index - 1].step >= step:
            index -= 1
        state.queue.insert(index, call)
        if placeholder is not None:
            state.queue.append(placeholder)
        state.pump()

    def close(self) -> None:
        """Stop the monitor (every row is finished) and forward every row still waiting.
        Optional (see the module docstring); idempotent."""
        self._finalizer()
        atexit.unregister(self._finalizer)

    def __enter__(self) -> MergingLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split_backends(logger: Any, gpu_backends: Sequence[str] | None
                    ) -> tuple[list[str] | None, list[str] | None]:
    """(backends that get GPU rows, the others) for a logger with named backends (verl's
    ``Tracking``: a ``logger`` dict and ``log(..., backend=)``), else ``(None, None)``."""
    names = getattr(logger, "logger", None)
    if not isinstance(names, Mapping) or not _takes_backend(logger):
        return None, None
    known = [str(n) for n in names]
    if gpu_backends is None:
        gpu = [n for n in known if n != CONSOLE]
    else:
        unknown = [b for b in gpu_backends if b not in known]
        if unknown:
            raise ValueError(f"gpu_backends {unknown} are not backends of this logger "
                             f"(it has {known})")
        gpu = list(gpu_backends)
    return gpu, [n for n in known if n not in gpu]


def _takes_backend(logger: Any) -> bool:
    try:
        params = inspect.signature(logger.log).parameters
    except (TypeError, ValueError):
        return False
    return "backend" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _has_sink(monitor: Any, sink: Any) -> bool:
    return any(s is sink for s in getattr(monitor, "sinks", ()))
