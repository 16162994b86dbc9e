"""W&B: rows into a wandb run, beside the user's own logging and never in its way.

How W&B counts steps (wandb 0.31, ``wandb-core``'s handling of ``run.log``): a run has one
pending history record at its current step ``S``.  ``run.log(d)`` (no ``step=``) adds ``d`` to
it and commits it (``S += 1``); ``run.log(d, step=n)`` commits the pending record first if
``n > S`` and moves ``S`` to ``n``, adds ``d`` and leaves it pending (unless ``commit=True``),
and **drops** ``d`` with a warning if ``n < S``; ``run.log(d, commit=False)`` only adds ``d`` to
the pending record.  A key logged twice into one record keeps the second value.

So a second writer that commits records of its own moves ``S`` ahead of a user who passes
``step=``, and W&B drops the user's next log ("Tried to log to step 11 that is less than the
current step 12").  This sink never does that while training runs:

* **Attach, don't commit.** A row is added to the pending record with ``commit=False``: it
  goes out with the user's next ``run.log`` (or with ``run.finish()``), on the user's step,
  and ``S`` does not move.  The user's values stay on the user's steps, whether they pass
  ``step=`` or not, use ``define_metric`` or not, log by hand or through Hugging Face,
  Lightning, Accelerate or verl.
* **At most one row per record.** A second row while the first still waits in the pending
  record would overwrite its keys.  It waits in this sink's queue until the user's next log
  gives it a record of its own, unless a record of its own is known to be safe: then the
  pending record is committed and the row waits in the next one (``run.log(row,
  step=S + 1)``).  Safe means ``S + 1`` is at most one past the newest step of the rows
  written (the user has passed that step: rows are finished a little after their step).
  When the user does not log to W&B, or logs less often than rows come, every row gets its
  record at once (the rows vouch for their steps); when the user logs every step, each user
  record carries one row (the engine finishes a row about a quarter of a second after its
  ``log()``, so rows come one per step, not in bursts).
* **Its own x-axis.** A row lands in whichever record is free, usually one or more user logs
  after its training step, so ``_step`` says nothing about it.  Each row carries its training
  step as ``gpulens/step`` (hidden) and every key it writes is declared with
  ``define_metric(key, step_metric="gpulens/step")``, one name at a time (W&B matches a glob
  such as ``gpu/*`` with ``filepath.Match``, where ``*`` does not cross ``/``, and picks among
  matching globs in no fixed order). GPU charts therefore show the same step numbers as the
  loss (when the loop passes the same step to :meth:`gpulens.Monitor.log` as to its own
  logging).  ``train/global_step`` is never written here: Hugging Face logs that key itself,
  and a value merged into its record would overwrite it.  Rows of a wall-clock record
  (``gpulens record``) use ``record/elapsed_s`` instead (:attr:`WandbSink.step_metric`).
* **At close** every row still queued gets a record (each commit moves ``S`` by one) and the
  last one stays in the pending record, for ``run.finish()`` or the user's next log.  A run
  this sink started itself is finished.

Limits.  Rows that wait in the queue reach W&B later (not on a wrong step: ``gpulens/step``
says where they belong); the queue holds at most ``MAX_QUEUE`` rows, beyond which the oldest
waiting row is overwritten by the next one in the same record (counted in
:attr:`WandbSink.rows_overwritten` and as dropped at stop, with a warning; a warning says so
once :data:`BEHIND_ROWS` wait).  That takes rows coming faster than the user logs for a long
time (a loop logging every few ms; an engine starved of CPU that finishes rows in bursts).  After
``stop()`` W&B's step can be a few steps past the last training step (the rows still
queued): a later ``wandb.log(..., step=s)`` lands if ``s`` is above it, or if it passes no
``step=`` (the step it reached is logged at INFO).  A user who passes ``step=`` in a unit
other than the steps given to ``Monitor.log`` (epochs) should keep GPU rows out of W&B or log
them the same way.  Rows share records with the user's values, so a key both write (say
``train/loss`` passed to ``Monitor.log`` and logged by hand) keeps only one of them in that
record: give such a scalar to one of the two, or use ``include_train=False``.  In W&B's
"shared" mode (several processes write one run, and W&B numbers
the steps) rows are simply logged.

**The hidden detail, at most once a second.** The default view's handful of keys go into
every row's record; the rest of the row (the hidden per-GPU detail: 40 keys at 1 GPU, 110 at
2, 260 at 8) goes into a record at most once every ``detail_interval`` seconds of the rows'
own times (:data:`DETAIL_INTERVAL_S`; ``GPULENS_WANDB_DETAIL_S``; 0: every row), on the
first row after it has passed.  ``run.log`` costs the training process's threads in
proportion to its keys, and at every step on 8 GPUs the detail was most of W&B's cost
(``benchmarks/results/2026-11-27-cpu-wandb-row-cost``); the JSONL record, the report and the
other sinks keep every row.  Rows come at most as often as the loop logs, so a run that logs
once a second or less gets the detail on every row.

**Definitions once per run object.** ``define_metric`` is a message to ``wandb-core``; the keys
defined are remembered per run object, so a sink writes each definition once.  In the engine
process each monitor attaches a run object of its own, so a second ``trainer.train()`` on the
same run defines its keys again there (once each, at its first rows).

**In the engine process, not the training process.** ``run.log`` costs about 1 ms of CPU a
row in the process that calls it (encoding, the socket to ``wandb-core``, W&B's asyncio
thread): on a training thread, Hugging Face logging every step paid +1.47 ms of CPU a step on
an H200 (``benchmarks/results/2026-11-26-h200-paths-aa``), and from a thread of the training
process still about +0.5 pp of the step (``benchmarks/results/2026-11-27-h200x2-*``).  So the
``"wandb"`` sink is built in gpulens's engine process: the monitor hands it the training
process's run (the one given, else ``wandb.run``) as a :class:`RunHandle`, and the engine
attaches to it through W&B's service (:mod:`gpulens.sinks.wandb_run`).  With no run at all the
engine starts one of its own (``wandb.init()`` from the environment's settings) and finishes it
at close; ``wandb.run`` in the training process stays ``None``.  A ``WandbSink`` object (or
``isolation="thread"``) writes from a thread of the training process, as before.

Each ``run.log`` goes to ``wandb-core`` whole, in the order it was made, so the only question a
second writer raises is which record a row joined.  ``run._local_step`` (W&B's mirror of
``S``, free to read) is read only in the process that made the run, where it may lag the
user's thread by a commit; it decides *whether* to place a row, never where one went: after
every placement the sink asks ``wandb-core`` for ``S`` (``run.step``, a round trip) and treats
the row as held by that record, which is the record it joined or a later one.  Either error
only makes a row wait for one more user log, never shares a record.  An attached run's mirror
counts only the engine's own commits, so there every decision asks ``wandb-core`` (0.3 ms a
round trip), and a thread looks for a free record every :data:`PLACE_POLL_S` while rows wait
(rows come in bursts, and a record frees up at each of the user's logs).  The one race left:
in the "record of its own" case, a user who logs two steps within the millisecond between the
sink's reading of ``S`` and its write makes W&B drop that row with its warning ("Tried to log
to step ...").  An attached run that no longer answers (the user finished it before the
monitor stopped) is waited for :data:`~gpulens.sinks.wandb_run.ANSWER_TIMEOUT_S` once; then
its rows are counted as dropped, with a warning.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import Any

from gpulens.log import logger as _log
from gpulens.log import one_line, warn_once
from gpulens.model import Event, Outcome, Row, RunContext
from gpulens.schema import STEP_KEY
from gpulens.sinks.layout import TrackerLayout, check_section, resolve_keys
from gpulens.sinks.wandb_run import (
    CONFIG_FROM_RUN,
    DETAIL_ENV,  # noqa: F401  (re-exported: gpulens.sinks.wandb.DETAIL_ENV)
    DETAIL_INTERVAL_S,  # noqa: F401
    RunGone,
    RunHandle,
    ask_step,
    check_wandb_login,
    check_wandb_ready,
    definitions,
    import_wandb,
    resolve_detail_interval,
    send_alert,
    write_run_metadata,
)

AXIS_KEY = "gpulens/step"
"""The hidden x-axis of every key this sink writes: the row's training step."""

PLACE_POLL_S = 0.02
PLACE_POLL_MAX_S = 0.2
"""With a run attached from the engine process: how often the sink asks W&B's step while rows
wait for a record (see the module doc): twice per period of W&B's step as the sink has seen it
advance (the user's logs free a record each), within [:data:`PLACE_POLL_S`,
:data:`PLACE_POLL_MAX_S`]; :data:`PLACE_POLL_S` until it has seen the step move.  Each ask is
a round trip to ``wandb-core`` (0.3 ms): a loop logging every 110 ms step is asked about
twice a step, not every 20 ms."""

MAX_QUEUE = 10_000
"""Rows :class:`WandbSink` keeps waiting for a record of their own."""

BEHIND_ROWS = 200
"""Rows waiting for a W&B record at which the sink says, once, that its rows fall behind."""


class WandbSink:
    """Logs rows to ``run`` (default: the active ``wandb.run``, else ``wandb.init()`` from W&B's
    own environment settings, finished again at close, with exit code 1 where training did not
    finish: :class:`~gpulens.sinks.base.EndsRun`). The module docstring: how rows join steps.

    Keys written (:mod:`gpulens.sinks.layout`): with ``keys="default"`` the tracker view, a
    handful of job-level GPU and throughput figures in the loss's section
    (``train/gpu_sm_active_pct_mean``, ``train/gpu_mem_used_gb_max``, ``train/mfu_pct`` ...),
    the ``train/*`` scalars unless ``include_train`` is off, any other key of the user's, and
    ``alerts/<rule>`` once that rule has fired; every other key of the row (``gpu/{i}/*``,
    ``gpu/all/*``, ``host/*``, ``perf/*`` ...) is logged too, under the schema's name, but
    hidden from W&B's automatic panels (``define_metric(hidden=True)``: the saved view of
    :mod:`gpulens.integrations.wandb_workspace` plots it).  With ``keys="all"`` every key of
    the row, under the schema's names, nothing hidden.  Never ``train/global_step``; always
    ``gpulens/step`` (the row's step, hidden) or, for wall-clock rows, their
    ``record/elapsed_s``.  The hidden keys go into a row's record at most once every
    ``detail_interval`` seconds (module doc); the shown ones into every row's.

    Also, at open, the run's metadata into the run's config under ``"gpulens"`` (version,
    backend, hostname, interval, GPUs, dtype and MFU peak ...: :func:`run_metadata`; the user's
    own keys are never touched; ``"gpulens_run"`` if the user's config has a ``"gpulens"`` key
    of its own) and, for simulated GPUs, the run tag ``simulated-gpus``; and for each alert
    that fires, ``run.alert(title="gpulens: <rule>", text=..., level="WARN"|"ERROR")`` (W&B
    mails or posts it where the user set alerts up; W&B itself holds back an alert of the same
    title within a minute).  None of these may stop a row: a failure is a warning, once.

    Args:
        run: a wandb run to log to.
        include_train: also write the ``train/*`` scalars.  Integrations whose framework logs
            loss to W&B itself turn this off, so each point is logged once and never lands on
            the framework's own key in the same record.
        keys: ``"default"`` or ``"all"``; ``None``: ``GPULENS_TRACKER_KEYS``, else default.
        section: the section of the default view's figures (``None``: ``train``, or ``gpu``
            for wall-clock rows; ``""``: bare keys).
        step_metric: the x-axis of the keys written (:attr:`step_metric`).
        detail_interval: seconds between two rows that carry the hidden keys (0: every row;
            ``None``: ``GPULENS_WANDB_DETAIL_S``, else :data:`DETAIL_INTERVAL_S`).
    """

    on_training_thread = False
    _exit_code = 0

    step_metric: str = AXIS_KEY
    """The x-axis of the keys written: ``"gpulens/step"`` (the row's training step, written
    into each record) or a key the rows carry themselves (``"record/elapsed_s"``)."""

    def __init__(self, run: Any | None = None, *, include_train: bool = True,
                 keys: str | None = None, section: str | None = None,
                 step_metric: str = AXIS_KEY, detail_interval: float | None = None) -> None:
        self._run: Any = run
        self._attached = False
        """The run is the training process's, attached from the engine process."""
        self._disabled = False
        """The run handed over is W&B's no-op run (``mode="disabled"``)."""
        self._gone: RunGone | None = None
        """Set once an attached run stopped answering: no more rows are written."""
        self._lock = threading.Condition()
        """Held while rows are placed (the writer's thread, and the placer's)."""
        self._placer: threading.Thread | None = None
        self._steps_seen: deque[tuple[float, int]] = deque(maxlen=8)
        """(monotonic time, W&B step) each time an attached run's step was seen to move."""
        self._config_seen: Any = None
        """The run config's ``"gpulens"`` entry as the training process saw it at start."""
        self.detail_interval = resolve_detail_interval(detail_interval)
        self.step_metric = step_metric
        self._owned = False
        self.include_train = include_train
        self.keys = resolve_keys(keys)
        self.section = check_section(section)
        self.rows_overwritten = 0
        """Rows overwritten in W&B by a later one (the queue was full; also in rows_lost)."""
        self._in_write = False
        self.alerts_sent = 0  # run.alert calls made for firing alerts
        self._reset()

    def _reset(self) -> None:
        self.rows_lost = 0
        """This run's rows taken that never reached W&B (counted dropped at stop)."""
        self.lost_why: str | None = None
        """Why rows were lost, for stop()'s WARNING (``None``: the run stopped answering)."""
        self._defined: dict[str, tuple[bool, str]] = {}
        self._detail_at: float | None = None
        """The time of the newest row written with the hidden keys."""
        self._queue: deque[dict[str, float]] = deque()
        self._attached_at: int | None = None
        """W&B step of the pending record that holds a row of ours, if any."""
        self._newest_step: int | None = None
        self._shared = False
        self._hidden: set[str] = set()
        self._layout = TrackerLayout(self.keys, section=self.section,
                                     include_train=self.include_train)

    @staticmethod
    def spec_options(arg: str | None) -> dict[str, Any]:
        """``"wandb"`` or ``"wandb:all"`` / ``"wandb:default"`` (the tracker key set)."""
        if arg and arg.strip().lower() not in ("all", "default"):
            raise ValueError(f"the wandb sink takes a key set ('wandb:all' or "
                             f"'wandb:default'), got 'wandb:{arg}'")
        return {"keys": arg.strip().lower()} if arg else {}

    @staticmethod
    def check_options(options: dict[str, Any]) -> dict[str, Any]:
        """``ValueError`` (one line) for an unknown key set or section, also where it comes from
        ``GPULENS_TRACKER_KEYS`` or ``GPULENS_WANDB_DETAIL_S`` (the engine reads them again)."""
        resolve_keys(options.get("keys"))
        check_section(options.get("section"))
        resolve_detail_interval(options.get("detail_interval"))
        metric = options.get("step_metric", AXIS_KEY)
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"the wandb sink's step_metric must be a key, got {metric!r}")
        run = options.get("run")
        if run is not None and not isinstance(run, RunHandle):
            options = {**options, "run": RunHandle(run)}
        return options

    @staticmethod
    def prepare_options(options: dict[str, Any]) -> dict[str, Any]:
        """At start, in the training process: the run to write to, as a :class:`RunHandle`
        for the engine process (the run given, else the active ``wandb.run``, read only where
        wandb is imported already: otherwise there is none); with none, the cheap checks of
        :func:`check_wandb_ready` (the engine then starts a run of its own)."""
        if options.get("run") is None:
            wandb = sys.modules.get("wandb")
            active = getattr(wandb, "run", None) if wandb is not None else None
            if active is not None:
                return {**options, "run": RunHandle(active)}
            check_wandb_ready()
        return options

    @classmethod
    def from_spec(cls, arg: str | None) -> WandbSink:
        """The sink of ``"wandb:..."``, built here."""
        return cls(**cls.check_options(cls.spec_options(arg)))

    def check(self) -> None:
        """``ValueError`` (one line), before anything is created, if ``open()`` would fail:
        wandb not installed, or no run, no login and not offline.  Imports wandb (about a
        second): ``Monitor.start()`` calls the cheap :meth:`prepare` instead."""
        try:
            import_wandb()
        except ImportError as exc:
            raise ValueError(str(exc)) from None
        if self._run is None:
            check_wandb_login()

    def prepare(self) -> None:
        """What ``Monitor.start()`` checks, cheaply (:func:`check_wandb_ready`); what it cannot
        tell without importing wandb, ``open()`` finds, off the training thread."""
        if self._run is None:
            check_wandb_ready()

    def open(self, context: RunContext) -> None:
        wandb = import_wandb()
        self._attached, self._gone, self._disabled, self.rows_lost = False, None, False, 0
        self._steps_seen.clear()
        if isinstance(self._run, RunHandle) and not self._run.disabled:
            self._config_seen = self._run.config_entry
            self._run, self._attached = self._run.resolve()
        if self._run is None:
            self._run = wandb.run
        if self._run is None:
            check_wandb_login()
            try:
                self._run = wandb.init()
            except Exception as exc:  # W&B's UsageError & co: one line, not its traceback
                raise ValueError(f"the wandb sink could not start a W&B run: "
                                 f"{one_line(exc)}") from None
            self._owned = True
        if getattr(self._run, "disabled", False) is True:  # W&B's no-op run: nothing to do
            self._disabled = True  # (mode="disabled": handed over, or WANDB_MODE at init)
            _log.info("gpulens: the W&B run is disabled (mode='disabled'): no GPU rows "
                      "go to W&B")
            return
        self._reset()
        self._defined = definitions(self._run)
        self._shared = getattr(getattr(self._run, "settings", None), "mode", None) == "shared"
        if self.step_metric == AXIS_KEY and AXIS_KEY not in self._defined:
            self._run.define_metric(AXIS_KEY, hidden=True)
            self._defined[AXIS_KEY] = (True, "")
        self._write_metadata(context)
        if self._attached and not self._shared:
            self._start_placer()

    def _start_placer(self) -> None:
        self._placer = threading.Thread(target=self._place_waiting, daemon=True,
                                        name="gpulens-wandb-place")
        self._placer.start()

    def _place_waiting(self) -> None:
        """The placer thread (attached runs): while rows wait, look for a free record every
        :meth:`_poll_interval` (rows come in bursts, and a record frees up at each of the
        user's logs, which this process does not see)."""
        lock = self._lock
        while True:
            with lock:
                while not self._queue and self._placer is not None:
                    lock.wait()
                if self._placer is None:
                    return
                lock.wait(self._poll_interval())
                if self._placer is None or self._gone is not None:
                    return
                try:
                    self._core_step()  # the newest S: has a record freed up?
                    self._place()
                except RunGone as exc:
                    self._run_gone(exc)
                except Exception as exc:  # the rows wait; the writer's next row tries again
                    warn_once("wandb-place", "gpulens: could not give a GPU row a W&B record: "
                              "%s", one_line(exc))

    def _poll_interval(self) -> float:
        """Half the period at which W&B's step has been seen to move, within the bounds of
        :data:`PLACE_POLL_S`."""
        seen = self._steps_seen
        if len(seen) < 2 or seen[-1][1] <= seen[0][1]:
            return PLACE_POLL_S
        period = (seen[-1][0] - seen[0][0]) / (seen[-1][1] - seen[0][1])
        return min(PLACE_POLL_MAX_S, max(PLACE_POLL_S, period / 2))

    def _write_metadata(self, context: RunContext) -> None:
        """The run's metadata into its config and, for simulated GPUs, a tag
        (:func:`write_run_metadata`)."""
        write_run_metadata(self._run, context,
                           seen=self._config_seen if self._attached else CONFIG_FROM_RUN)

    def _data(self, row: Row) -> dict[str, float]:
        shown, detail = self._layout.split(row.values)
        data: dict[str, float] = {}
        for key, value in shown.items():
            if key != STEP_KEY:
                data[key] = value
        due = self._detail_at
        if due is None or row.time >= due + self.detail_interval or row.time < due:
            self._detail_at = row.time  # (a clock that went back starts the interval again)
            for key, value in detail.items():
                if key not in data:
                    data[key] = value
                    self._hidden.add(key)
        if self.step_metric == AXIS_KEY:
            data[AXIS_KEY] = float(row.step)
        return data

    def _define(self, data: dict[str, float]) -> None:
        run: Any = self._run
        defined, axis = self._defined, self.step_metric
        for key in data:
            hidden = key in self._hidden
            if defined.get(key) != (hidden, axis) and key != axis:
                if hidden:
                    run.define_metric(key, step_metric=self.step_metric, hidden=True)
                else:
                    run.define_metric(key, step_metric=self.step_metric)
                defined[key] = (hidden, axis)

    def _alert(self, event: Event) -> None:
        if send_alert(self._run, event):
            self.alerts_sent += 1

    def _wandb_step(self) -> int | None:
        """W&B's step ``S`` as this process's wandb mirrors it (free; may lag a commit the
        user's thread is making), else as ``wandb-core`` has it."""
        local = self._mirror_step()
        return local if local is not None else self._core_step()

    def _mirror_step(self) -> int | None:
        """``S`` as this process's wandb mirrors it (read for free), if it does.  An attached
        run's own mirror counts only this process's commits and is never read: there the
        mirror is the newest ``S`` ``wandb-core`` answered, which lags like a mirror does
        (only ever behind), so it may decide *whether* to place a row, as a mirror does."""
        if self._attached:
            seen = self._steps_seen
            return seen[-1][1] if seen else None
        local = getattr(self._run, "_local_step", None)
        return local if isinstance(local, int) else None

    def _core_step(self) -> int | None:
        """``S`` as ``wandb-core`` has it, after every ``run.log`` this thread made (a round
        trip)."""
        run: Any = self._run
        if self._attached:
            step = ask_step(run)  # a bounded wait; RunGone once the run no longer answers
            seen = self._steps_seen
            if not seen or step > seen[-1][1]:
                seen.append((time.monotonic(), step))
            return step
        try:
            return int(run.step)
        except Exception:
            return None

    def _held_by(self, guess: int) -> int:
        """The record that holds the row just placed, or a later one (see the docstring)."""
        held = self._core_step()
        if held is None:  # wandb-core did not answer: its mirror, read for free
            held = self._mirror_step()
        return guess if held is None else max(guess, held)

    def _place(self, *, final: bool = False) -> None:
        """Give queued rows records (see the module docstring), oldest first."""
        run: Any = self._run
        queue = self._queue
        while queue:
            step = None if self._shared else self._wandb_step()
            if step is None:
                if not self._shared:
                    warn_once("wandb-step", "gpulens: W&B's step cannot be read; GPU rows are "
                              "logged as records of their own")
                run.log(queue[0])
                queue.popleft()
                continue
            if self._attached_at is not None and self._attached_at >= step and (
                    final or self._may_commit(step)):
                # the mirror may lag: ask wandb-core before committing a record of our own
                step = self._core_step() if not final else step
                if step is None:
                    break
            if self._attached_at is None or self._attached_at < step:
                run.log(queue[0], commit=False)  # the pending record holds none of ours
                queue.popleft()
                self._attached_at = self._held_by(step)
            elif final or self._may_commit(step):
                if self._attached:  # W&B warns about step= from a second process
                    run.log({}, commit=True)
                    run.log(queue[0], commit=False)
                else:
                    run.log(queue[0], step=step + 1)
                queue.popleft()
                self._attached_at = self._held_by(step + 1)
            else:
                break
        while len(queue) > MAX_QUEUE:
            step = self._core_step()  # the row takes a free record, else ours in it
            run.log(queue[0], commit=False)
            queue.popleft()
            if step is not None and (self._attached_at is None or self._attached_at < step):
                self._attached_at = self._held_by(step)
                continue
            self.rows_overwritten += 1
            self.rows_lost += 1  # counted dropped at stop, not written
            self.lost_why = "W&B records did not free up for them: overwritten by later rows"
            warn_once("wandb-overwritten", "gpulens: GPU rows come faster than W&B records "
                      "free up for them (%d waiting); some are overwritten in W&B by later "
                      "ones (the other sinks have them all)", MAX_QUEUE)
        if len(queue) >= BEHIND_ROWS and not final:
            warn_once("wandb-behind", "gpulens: GPU rows reach W&B %d rows behind training "
                      "(newest: step %s): W&B records free up for them slower than they come "
                      "(one row a record of yours); those waiting are written at stop(), a W&B "
                      "step each past your last one (%d at most): call Monitor.log less often "
                      "to keep up", len(queue), self._newest_step, MAX_QUEUE)

    def _may_commit(self, step: int) -> bool:
        """Whether a record of our own at ``step + 1`` stays at or below the user's next step."""
        return self._newest_step is not None and step + 1 <= self._newest_step + 1

    @property
    def rows_waiting(self) -> int:
        """Rows taken (written, to the writer) that wait in the queue for a W&B record: lost
        if the sink is given up before it closes (read without the lock, which a write stuck
        on a run that no longer answers holds; the row of that write is the writer's)."""
        waiting = len(self._queue)
        return max(0, waiting - 1) if self._in_write else waiting

    def write(self, row: Row) -> None:
        if self._disabled:
            return
        assert self._run is not None, "WandbSink.write before open"
        for event in row.events:
            if event.kind == "alert" and event.state == "firing":
                self._alert(event)
        with self._lock:
            if self._gone is not None:
                raise self._gone
            self._in_write = True
            try:
                self._write(row)
            finally:
                self._in_write = False

    def _write(self, row: Row) -> None:
        """:meth:`write`'s part under the lock: queue the row's record, and place what can be."""
        data = self._data(row)
        self._define(data)
        if self._newest_step is None or row.step > self._newest_step:
            self._newest_step = row.step
        was_empty = not self._queue
        self._queue.append(data)
        try:
            if self._attached and was_empty:
                self._core_step()  # the newest S: the row may have a record at once
            self._place()
        except RunGone as exc:
            self._run_gone(exc, holding=1)  # this row stays the writer's (raised)
            raise
        except Exception as exc:  # the row is queued: placed later, never queued twice
            warn_once("wandb-place", "gpulens: could not give a GPU row a W&B record: "
                      "%s", one_line(exc))
            while len(self._queue) > MAX_QUEUE:  # a run that keeps refusing: bounded
                self._queue.popleft()
                self.rows_lost += 1
        if self._queue and was_empty:
            self._lock.notify()  # the placer looks for free records while rows wait

    def _run_gone(self, exc: RunGone, holding: int = 0) -> None:
        """The run stopped answering: said once, the rows lost counted (not ``holding``)."""
        self._gone = exc
        lost, self._queue = len(self._queue), deque()
        self.rows_lost += max(0, lost - holding)
        warn_once("wandb-gone", "gpulens: %s; %d GPU row(s) waiting for a W&B record are lost "
                  "and later rows are not written to W&B (counted; the other sinks have them)",
                  exc, lost)

    def end_run_as(self, outcome: Outcome) -> None:
        self._exit_code = 0 if outcome == "finished" else 1

    def close(self) -> None:
        placer, self._placer = self._placer, None
        if placer is not None:
            with self._lock:
                self._lock.notify()
            placer.join(timeout=10)
        with self._lock:
            try:
                self._close()
            finally:  # also when it raised: a sink opened again never reuses a finished run
                self._run, self._owned = None, False

    def _close(self) -> None:
        run: Any = self._run
        if run is not None and self._gone is None and not self._disabled:
            queued = len(self._queue)
            try:
                self._place(final=True)
                step = None if self._shared else self._wandb_step()
                if queued > 1 and step is not None and self._newest_step is not None \
                        and step > self._newest_step + 1:
                    _log.info("gpulens: the last %d GPU rows took W&B steps of their own; W&B's "
                              "step is now %d (a later wandb.log(step=s) needs s >= %d)",
                              queued, step, step)
            except RunGone as exc:
                self._run_gone(exc)
                raise
            except Exception as exc:  # its service went away (MailboxClosedError, ...)
                gone = RunGone(f"W&B's run stopped answering at stop: {one_line(exc)}")
                self._run_gone(gone)
                raise gone from exc
            finally:
                if self._owned:
                    run.finish(exit_code=self._exit_code)
