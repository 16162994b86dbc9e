"""The lifecycle every framework integration shares: one training run's monitor, from the start
of training to its one stop, a row per framework log.

The Hugging Face and Lightning callbacks (:mod:`gpulens.integrations.transformers`,
:mod:`gpulens.integrations._lightning_common`) only translate their framework's hooks into
calls on a :class:`TrainingSession`::

    session = TrainingSession(monitor, start_step=s, steps_done=s, phases=StepPhases(cuda=...),
                              work=counter)
    session.start()                      # training starts (nothing runs before this)
    session.step_begin()                 # the phase marks (:mod:`gpulens.integrations.phases`)
    session.before_optimizer()
    session.step_end()
    session.resume()                     # after logging, evaluation, a checkpoint, an epoch end
    session.row(step, steps_done, scalars)   # the framework logged: one row
    session.stop()                       # training ended: every rank's last rows meet
    session.stop(collective=False)       # an exception on this rank: no gather

What it guarantees:

* **One row per framework log**, holding the framework's scalars, the phase figures of the
  optimizer steps since the previous row (``steps_done`` counts optimizer steps; the window's
  steps are the difference) and the work counted in that window (tokens, FLOPs, samples), as
  :meth:`gpulens.Monitor.log` keywords. The work values may be deferred counts
  (:meth:`gpulens.work.hf.TokenCounter.take_deferred`): the monitor reads them off the training
  thread.
* **One stop.** :meth:`stop` is idempotent; it stops the monitor and lets go of the work
  counter (the forward hook it put on the model). ``collective=False`` is for exception paths:
  this rank's last windows are not gathered, since the other ranks may be stuck in training's
  own collectives.
* **A finalizer without a reference cycle.** When a session is dropped without a stop (the
  framework raised and has no exception hook: Hugging Face), garbage collection or interpreter
  exit stops the monitor with ``collective=False`` and detaches the counter. The finalizer holds
  the monitor and the counter, never the session or the callback, so a dropped callback is
  collected as soon as its last reference goes.

:class:`SessionCallback` is what the two callbacks hold between hooks: their arguments, checked
when the callback is made, and the running session.

:class:`StepGate` is the window rule of the integrations that are fed by a loop's own log calls
at the loop's own steps (Accelerate's tracker, verl's logger).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from enum import Enum
from typing import Any, Protocol

from gpulens.integrations.phases import StepPhases
from gpulens.monitor import Monitor
from gpulens.settings import Settings, normalize_run_dtype
from gpulens.sinks import SinkSpec, as_sink
from gpulens.sinks.base import Sink

__all__ = ["GateAction", "SessionCallback", "StepGate", "TrainingSession", "WorkSource",
           "monitor_for_run"]


def monitor_for_run(settings: Settings, sinks: Iterable[str | SinkSpec | Sink],
                    dtype: Any = None) -> Monitor:
    """The (unstarted) monitor of one training run: the callback's settings, checked when the
    callback was made, with the run's sinks and, where the settings name no dtype, the run's."""
    return Monitor.from_settings(replace(
        settings, sinks=tuple(as_sink(s) for s in sinks),
        dtype=settings.dtype if settings.dtype is not None else normalize_run_dtype(dtype)))


class WorkSource(Protocol):
    """Counts the work of a run's training steps (:class:`gpulens.work.hf.TokenCounter`, the
    Lightning callback's per-batch counter)."""

    def take_deferred(self) -> dict[str, Any]:
        """The work since the previous call as ``Monitor.log`` keywords (``tokens``, ``flops``,
        ``samples``; ``{}`` when none was counted)."""
        ...

    def close(self) -> None:
        """Stop counting (detach any hook)."""
        ...


def _finish(monitor: Monitor, work: WorkSource | None) -> None:
    """The finalizer: the session was dropped without a stop."""
    try:
        monitor.stop(collective=False)
    finally:
        if work is not None:
            work.close()


class TrainingSession:
    """One training run of a framework integration (see the module docstring).

    Args:
        monitor: an unstarted monitor with the run's sinks and dtype.
        start_step: the step the monitor's first window starts after (``Monitor.start``).
        steps_done: optimizer steps done when training starts (a resumed run's restored count).
        phases: times the phases of each step (``None``: no ``perf/*`` phase keys).
        work: counts each window's work (``None``: none counted).
    """

    def __init__(self, monitor: Monitor, *, start_step: int, steps_done: int,
                 phases: StepPhases | None = None, work: WorkSource | None = None) -> None:
        self.monitor = monitor
        self.phases = phases
        self.work = work
        self.steps_done = int(steps_done)
        """Optimizer steps done at the previous row (or at the start)."""
        self._start_step = int(start_step)
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def running(self) -> bool:
        return self._finalizer is not None

    def start(self) -> TrainingSession:
        """Start the monitor; on failure, let go of the work counter and raise."""
        try:
            self.monitor.start(step=self._start_step)
        except BaseException:
            if self.work is not None:
                self.work.close()
            raise
        self._finalizer = weakref.finalize(self, _finish, self.monitor, self.work)
        if self.phases is not None:
            self.phases.resume()
        return self

    def stop(self, collective: bool = True) -> None:
        """Stop the monitor (writing every row it holds) and the work counter. Idempotent.
        ``collective=False``: this rank alone, no gather (exception paths)."""
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is None or not finalizer.detach():
            return
        try:
            self.monitor.stop(collective=collective)
        finally:
            if self.work is not None:
                self.work.close()

    # -- the phase marks ---------------------------------------------------------------------
    def step_begin(self) -> None:
        if self.phases is not None:
            self.phases.step_begin()

    def before_optimizer(self) -> None:
        if self.phases is not None:
            self.phases.before_optimizer()

    def step_end(self) -> None:
        if self.phases is not None:
            self.phases.step_end()

    def resume(self) -> None:
        if self.phases is not None:
            self.phases.resume()

    # -- rows --------------------------------------------------------------------------------
    def steps_since_row(self, steps_done: int) -> int:
        """Optimizer steps between the previous row (or the start) and ``steps_done``."""
        return int(steps_done) - self.steps_done

    def row(self, step: int, steps_done: int, scalars: Mapping[str, Any]) -> None:
        """End the window at ``step`` and write one row: ``scalars``, the phase figures of the
        window's optimizer steps and its work. ``steps_done``: optimizer steps done by now."""
        values = dict(scalars)
        if self.phases is not None:
            values.update(self.phases.collect(self.steps_since_row(steps_done)))
        if self.work is not None:
            values.update(self.work.take_deferred())
        self.monitor.log(step, **values)
        self.steps_done = int(steps_done)


class SessionCallback:
    """What a framework callback keeps between hooks (mixed into the Hugging Face and Lightning
    callbacks): its arguments, checked when it is made by the core's own checks (nothing starts
    then; each training run's monitor is made from them with that run's sinks and dtype), and
    the :class:`TrainingSession` of the running training run.

    Args: as the callbacks' (``sinks``, ``interval``, ``gpus``, ``backend``, ``tracker_keys``,
    ``phases``, ``work``).
    """

    def __init__(self, sinks: Sequence[str | Sink] | None, interval: float,
                 gpus: Sequence[int] | None, backend: str | None, tracker_keys: str | None,
                 phases: bool, work: bool) -> None:
        super().__init__()
        from gpulens.sinks.layout import resolve_keys

        self.sinks: list[str | Sink] = list(sinks or ())
        self.settings = Settings(gpus=None if gpus is None else tuple(gpus), interval=interval,
                                 sinks=tuple(as_sink(s) for s in self.sinks), backend=backend)
        self.tracker_keys = resolve_keys(tracker_keys)
        self.time_phases = phases
        self.count_work = work
        self.session: TrainingSession | None = None

    @property
    def monitor(self) -> Monitor | None:
        """The running training run's monitor (``None`` outside one)."""
        return self.session.monitor if self.session is not None else None

    def _phases(self, device: Any) -> StepPhases | None:
        """The phase timer of a run on ``device`` (on the GPU's timeline for a CUDA device);
        ``None`` when phases are off."""
        if not self.time_phases:
            return None
        return StepPhases(cuda=getattr(device, "type", None) == "cuda")

    def _stop(self, collective: bool = True) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.stop(collective=collective)


class GateAction(Enum):
    START = "start"
    """Start the first window after this step (no row)."""
    ROW = "row"
    """End the window at this step: one row."""
    PASS = "pass"
    """A step already ended (or an earlier one): nothing."""


class StepGate:
    """Windows ended by a loop's own log calls at its own steps: the first call starts the
    first window after its step (so a resumed run's first row counts only the steps it ran), a
    call at a later step ends a window, calls at that step or an earlier one pass (a loop that
    logs training, then evaluation, at one step ends one window)."""

    def __init__(self) -> None:
        self.last: int | None = None
        """The highest step seen."""

    def at(self, step: int, started: bool) -> GateAction:
        """What a log call at ``step`` does; ``started``: the window is open already."""
        last = self.last
        self.last = step if last is None else max(last, step)
        if not started:
            return GateAction.START
        if last is None or step > last:
            return GateAction.ROW
        return GateAction.PASS
