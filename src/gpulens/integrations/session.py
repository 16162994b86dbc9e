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
    session.row(step, steps_done, scalars, later=True)   # ... written after the next forward
    session.stop()                       # training ended: every rank's last rows meet
    session.stop(collective=False, outcome="failed")   # an exception on this rank: no gather

What it guarantees:

* **One row per framework log**, holding the framework's scalars, the phase figures of the
  optimizer steps since the previous row (``steps_done`` counts optimizer steps; the window's
  steps are the difference) and the work counted in that window (tokens, FLOPs, samples), as
  :meth:`gpulens.Monitor.log` keywords. The work values may be deferred counts
  (:meth:`gpulens.work.hf.TokenCounter.take_deferred`): the monitor reads them off the training
  thread.
* **Nothing launched just after a sync.** Where the framework logs right after it synchronised
  the device (Hugging Face reads the loss with ``.item()`` and then calls ``on_log``), what the
  row does on the training thread before the next step's first kernel is time the device sits
  idle: on an H200 the phase figures and token counts written there cost +0.39 pp of a 98 ms
  step, and the row alone +0.07 (``benchmarks/results/2026-11-27-h200-session-parts``). So
  ``row(..., later=True)`` only notes where the window ends (a clock read, two counters) and
  writes the row later, with the window still ending at the log: at the end of the next
  training forward of the session's ``model`` (its kernels queued: the device is busy), or
  without a model at the next ``before_optimizer`` / ``step_end`` mark. The step's kept masks
  are turned into token counts at the same points (``WorkSource.settle``). Hugging Face also
  synchronises after every backward (``isnan(loss)``), so its marks come while the device
  waits: there only a CUDA event is recorded.
* **One stop.** :meth:`stop` is idempotent; it stops the monitor and lets go of the work
  counter (the forward hook it put on the model). ``collective=False`` is for exception paths:
  this rank's last windows are not gathered, since the other ranks may be stuck in training's
  own collectives.
* **A finalizer without a reference cycle.** When a session is dropped without a stop (the
  framework raised and has no exception hook: Hugging Face), garbage collection or interpreter
  exit writes a row still held for later, stops the monitor with ``collective=False`` and
  detaches the counter. The finalizer holds the monitor, the counter and the held row, never
  the session or the callback, so a dropped callback is collected as soon as its last
  reference goes. Its exit hook is registered with ``atexit`` when the session starts, after
  the trackers' runs began, so that at exit it runs before W&B's own hook ends W&B's service.

:class:`SessionCallback` is what the two callbacks hold between hooks: their arguments, checked
when the callback is made, and the running session.

:class:`StepGate` is the window rule of the integrations that are fed by a loop's own log calls
at the loop's own steps (Accelerate's tracker, verl's logger).
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Protocol

from gpulens.finalizers import drop_exit_finalizer, exit_finalizer, unfinished_outcome
from gpulens.integrations.phases import StepPhases
from gpulens.log import warn_once
from gpulens.model import Outcome
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

    def settle(self) -> None:
        """Launch what the kept batches' counts need (called where the device is busy)."""
        ...

    def cut(self) -> WorkSource:
        """The work so far as a source of its own, taken later (a row written ``later``); no
        device operation. This one starts again."""
        ...

    def close(self) -> None:
        """Stop counting (detach any hook)."""
        ...


@dataclass(slots=True)
class _Held:
    """A row of ``row(..., later=True)``, waiting for the next mark: its step, the window's
    optimizer steps, the framework's scalars, where the window ended (the phases' cut, the
    work's, the clocks: ``time.monotonic()``, ``time.time()``)."""

    step: int
    steps: int
    scalars: dict[str, Any]
    phases_cut: int | None
    work: WorkSource | None
    at: tuple[float, float]


def _write(monitor: Monitor, held: _Held, phases: StepPhases | None) -> None:
    values = dict(held.scalars)
    if phases is not None and held.phases_cut is not None:
        values.update(phases.collect(held.steps, upto=held.phases_cut))
    if held.work is not None:
        values.update(held.work.take_deferred())
    monitor.log_at(held.at, held.step, **values)


def _finish(monitor: Monitor, work: WorkSource | None, box: list[_Held], hook: Any) -> None:
    """The finalizer: the session was dropped without a stop, so its training never reached
    the framework's end hook (which stops it): a run of gpulens's own ends ``FAILED``
    (``KILLED`` where the script ends on a ``KeyboardInterrupt``)."""
    if hook is not None:
        hook.remove()
    try:
        if box:
            try:
                _write(monitor, box.pop(), None)
            except Exception as exc:  # the stop below must still run
                warn_once("session:held", "gpulens: a row could not be written (%r)", exc)
        monitor.stop(collective=False, outcome=unfinished_outcome())
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
        model: the model the training loop runs (a ``torch.nn.Module``): the end of each of
            its training forwards is where the device is busy for certain (its kernels are
            queued), so the session does its launches and writes there (:meth:`_busy_device`,
            from a forward hook that holds the session weakly); ``None``: at the marks only.
    """

    def __init__(self, monitor: Monitor, *, start_step: int, steps_done: int,
                 phases: StepPhases | None = None, work: WorkSource | None = None,
                 model: Any = None) -> None:
        self.monitor = monitor
        self.phases = phases
        self.work = work
        self._model = model
        self._hook: Any = None
        """The forward hook on ``model`` (a ``RemovableHandle``) while the session runs."""
        self.steps_done = int(steps_done)
        """Optimizer steps done at the previous row (or at the start)."""
        self._start_step = int(start_step)
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self.dropped_rows = 0
        """Rows held for later that could not be written (said once)."""
        self._held: list[_Held] = []
        """The row of ``row(..., later=True)`` until the next mark writes it (at most one)."""

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
        if self._model is not None:
            try:
                self._hook = _after_forwards(self._model, self)
            except Exception as exc:  # a model that takes no hook: the marks do the work
                warn_once("session:hook", "gpulens: cannot hook the model's forward (%r); "
                          "rows and token counts are written at the step hooks instead", exc)
        # made after the trackers' runs began: at an exit with the session still running
        # (train() raised and the script ended) the rows go out while W&B's service lives
        self._finalizer = exit_finalizer(self, _finish, self.monitor, self.work, self._held,
                                         self._hook)
        if self.phases is not None:
            self.phases.resume()
        return self

    def stop(self, collective: bool = True, outcome: Outcome = "finished") -> None:
        """Stop the monitor (writing every row it holds) and the work counter. Idempotent.
        ``collective=False``: this rank alone, no gather (exception paths); ``outcome``: how
        training ended (:meth:`gpulens.Monitor.stop`)."""
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is None or not drop_exit_finalizer(finalizer):
            return
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()
        try:
            self._write_held()
            self.monitor.stop(collective=collective, outcome=outcome)
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
        self._busy_device()

    def step_end(self) -> None:
        if self.phases is not None:
            self.phases.step_end()
        self._busy_device()

    def micro_step_end(self) -> None:
        """A micro-batch's backward was launched (gradient accumulation; Hugging Face's
        ``on_substep_end``): its counts are settled here, while the device is busy, so the
        masks kept never outnumber one micro-batch's."""
        if self.work is not None:
            self.work.settle()

    def _busy_device(self) -> None:
        """The step's masks into counts, a held row written: work launched where the device
        is busy, so that it hides behind the step. Called at the end of each training forward
        of the session's ``model`` and at the ``before_optimizer`` / ``step_end`` marks: with
        a model the forward has done it and a mark finds nothing left; without one the marks
        do it all."""
        if self.work is not None:
            self.work.settle()
        if self._held:
            self._write_held()

    def resume(self) -> None:
        if self.phases is not None:
            self.phases.resume()

    # -- rows --------------------------------------------------------------------------------
    def steps_since_row(self, steps_done: int) -> int:
        """Optimizer steps between the previous row (or the start) and ``steps_done``."""
        return int(steps_done) - self.steps_done

    def row(self, step: int, steps_done: int, scalars: Mapping[str, Any], *,
            later: bool = False, at: tuple[float, float] | None = None) -> None:
        """End the window at ``step`` and write one row: ``scalars``, the phase figures of the
        window's optimizer steps and its work. ``steps_done``: optimizer steps done by now.

        ``later``: the framework calls this just after it synchronised the device (see the
        module doc): note where the window ends now, write the row at the next
        ``before_optimizer`` / ``step_end`` mark (or at :meth:`stop`, or :meth:`flush`).
        ``at``: the window ended earlier, at these clocks (``time.monotonic(), time.time()``),
        with no step, forward or mark since (Hugging Face's end-of-training summary log, the
        row written at ``on_train_end``)."""
        self._write_held()  # a row still held (no mark came between two logs) goes first
        steps = self.steps_since_row(steps_done)
        self.steps_done = int(steps_done)
        if later:
            self._held.append(_Held(
                int(step), steps, dict(scalars),
                self.phases.cut() if self.phases is not None else None,
                self.work.cut() if self.work is not None else None,
                (time.monotonic(), time.time())))
            return
        values = dict(scalars)
        if self.phases is not None:
            values.update(self.phases.collect(steps))
        if self.work is not None:
            values.update(self.work.take_deferred())
        self.monitor.log_at(at, step, **values)

    def flush(self) -> None:
        """Write a row still held for later now (Hugging Face: an evaluation's first batch, a
        save)."""
        self._write_held()

    def _write_held(self) -> None:
        if not self._held:
            return
        try:
            _write(self.monitor, self._held.pop(), self.phases)
        except Exception as exc:  # a monitoring fault never stops training: said, counted
            self.dropped_rows += 1
            warn_once("session:held", "gpulens: a row could not be written (%r); rows that "
                      "fail so are counted in TrainingSession.dropped_rows", exc)


def _after_forwards(model: Any, session: TrainingSession) -> Any:
    """A forward hook on ``model`` that calls ``session._busy_device()`` after each training
    forward was launched (the session held weakly: a model kept by the user never keeps a
    dropped session, its monitor and its finalizer alive). Hugging Face's ``Trainer``
    synchronises the device after every backward (``logging_nan_inf_filter``'s
    ``isnan(loss)``), so from there to the next forward its queue is empty and every
    microsecond of host work at ``on_pre_optimizer_step``, ``on_step_end`` and
    ``on_step_begin`` is a microsecond the device waits; at the end of a forward the host is
    ahead of the device by the forward's own run time.

    Only forwards on the thread that started the session count: ``nn.DataParallel`` (what
    Hugging Face wraps a model in on several GPUs without a launcher) runs its replicas'
    forwards, hooks included, on threads of its own at once; the session is not thread-safe,
    so there the marks do the work.

    The hook is also called when the forward raises (``always_call``): the row held since the
    previous log (its window ended there) is handed to the monitor then, not left in the
    session until it is stopped. Hugging Face has no exception hook, so a failed ``train()``
    in a notebook leaves the session running until the callback is collected; a user who
    ends the W&B run first (``wandb.finish()``) lost that row in W&B. The failed forward's
    masks are not counted."""
    ref = weakref.ref(session)
    owner = threading.get_ident()

    def after_forward(module: Any, args: Any, output: Any) -> None:
        live = ref()
        if live is not None and module.training and threading.get_ident() == owner:
            try:
                if output is None and sys.exc_info()[0] is not None:
                    live.flush()  # the forward raised (torch calls this in its except)
                else:
                    live._busy_device()
            except Exception as exc:  # never into training
                warn_once("session:forward", "gpulens: %r after a forward; its counts and "
                          "rows are written at the step's marks instead", exc)

    try:
        return model.register_forward_hook(after_forward, always_call=True)
    except TypeError:  # a torch before always_call (2.0): not on a raising forward
        return model.register_forward_hook(after_forward)


class SessionCallback:
    """What a framework callback keeps between hooks (mixed into the Hugging Face and Lightning
    callbacks): its arguments, checked when it is made by the core's own checks (nothing starts
    then; each training run's monitor is made from them with that run's sinks and dtype), and
    the :class:`TrainingSession` of the running training run.

    Args: as the callbacks' (``sinks``, ``interval``, ``gpus``, ``backend``, ``tracker_keys``,
    ``phases``, ``work``, ``gpm``).
    """

    def __init__(self, sinks: Sequence[str | Sink] | None, interval: float,
                 gpus: Sequence[int] | None, backend: str | None, tracker_keys: str | None,
                 phases: bool, work: bool, gpm: bool = True) -> None:
        super().__init__()
        from gpulens.sinks.layout import resolve_keys

        self.sinks: list[str | Sink] = list(sinks or ())
        self.settings = Settings(gpus=None if gpus is None else tuple(gpus), interval=interval,
                                 sinks=tuple(as_sink(s) for s in self.sinks), backend=backend,
                                 gpm=gpm)
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

    def _stop(self, collective: bool = True, outcome: Outcome = "finished") -> None:
        session, self.session = self.session, None
        if session is not None:
            session.stop(collective=collective, outcome=outcome)


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
