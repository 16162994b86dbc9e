"""The engine in a process of its own (the default), so that monitoring takes nothing from
training.

In the training process, an engine thread would compete with the training thread for the
GIL: each time it wakes it waits for the interpreter, then holds it while it reads and finishes
rows, and a tracker client (MLflow's is pure Python, ~20 ms of CPU a row) holds it longer.
Here the training process keeps only this:

* ``log()`` pickles the mark (step, time, scalars) and writes it to a pipe without blocking:
  a few microseconds, no thread woken in this process;
* once a slow period, ``log()`` also reads the torch allocator's counters (one host-side call),
  which another process cannot see (the mark carries them);
* rows for the sinks that live in this process (W&B, whose run object is here; a framework's
  loggers; every sink given as an object) and for the distributed gather come back on a pipe
  of their own, which ``log()`` reads without waiting (:meth:`ProcessTransport.take_rows`): a
  row reaches them at the ``log()`` after its window closed.  No thread of this process wakes
  for a row: each wake takes the GIL from a training thread that is busy on the CPU (the link
  thread that read every row took 0.15-0.19 ms of CPU a step on H100 and H200 hosts,
  ``benchmarks/results/2026-11-27-h100-relay-at-log``);
* a link thread that sleeps in ``os.read`` and wakes only for what must happen here: the
  engine's log records, re-emitted through this process's ``gpulens`` logger at their level;
  the engine's sink figures (every second, so they are known even if it dies; at that wake it
  also hands on the rows when ``log()`` has taken none for a second: a loop that stopped
  logging); the answers of :meth:`ProcessTransport.latest`; and the end (the last rows are
  handed on before ``stop()`` returns).

The engine process (``python -c "...child.main(...)"``: :mod:`gpulens.transport.child`)
builds an :class:`~gpulens.engine.engine.Engine` from the
:class:`~gpulens.engine.spec.EngineSpec` it is sent.  It ignores SIGINT and SIGTERM (the
training process decides when to stop; torchrun's SIGTERM reaches the rank's process group)
and stops by itself, writing what it holds, when the training process
goes away (end of file on the pipe).  It polls its pipe every :data:`POLL_S` instead of
sleeping in ``read``: a write that must wake a sleeping reader costs the writer (the training
thread) more (``benchmarks/pipe_wake.py``).

Messages: :mod:`gpulens.transport.messages`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gpulens.engine.spec import EngineSpec
from gpulens.log import Laps, logger, reemit, warn_once
from gpulens.model import JobShape, MarkFields, Outcome, Row, RunContext, SinkStats
from gpulens.sources.processes import GpuProcess
from gpulens.transport import spawn
from gpulens.transport.base import SpawnFailed
from gpulens.transport.messages import (
    Drain,
    Drained,
    Failed,
    Finish,
    Job,
    LatestAsk,
    LatestReply,
    LogOut,
    ProcessesAsk,
    ProcessesReply,
    Ready,
    RowOut,
    Start,
    Stats,
    StatsOut,
    Stop,
    Stopped,
)
from gpulens.transport.pipe import LinkClosed, Receiver, Sender

READY_TIMEOUT_S = 120.0
"""How long ``start()`` waits for the engine process to open NVML and its sinks (importing
MLflow can take seconds on a loaded machine)."""
POLL_S = 0.02
"""How often the engine process looks for step marks (they wait at least 0.2 s for the data
that closes their window anyway)."""
STATS_EVERY_S = 1.0
"""How often the engine process sends its sinks' figures."""
STOP_GRACE_S = 10.0
"""Beyond the stop timeout: time for the engine process to close windows and exit."""


class _EndedFirst(SpawnFailed):
    """The engine process ended before it answered its ``Start``; ``how``: in words
    (:func:`how_it_ended`)."""

    def __init__(self, how: str) -> None:
        super().__init__(f"the engine process ended before it started ({how})")
        self.how = how


def how_it_ended(proc: subprocess.Popen[bytes], wait_s: float = 1.0) -> str:
    """How the engine process ended, in words: ``"exit code 1"``, ``"killed by SIGTERM"``.
    Its pipe closes a moment before the kernel reports the exit: wait up to ``wait_s`` for
    that (called where nothing else waits: the link thread as it ends, a failed start)."""
    try:
        code = proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        return f"it closed its pipe and had not exited {wait_s:g} s later"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit code {code}"


class ProcessTransport:
    """:class:`~gpulens.transport.base.Transport` to an engine in a process of its own.

    Only the process that started it talks to it: in a child forked from that process
    (``os.fork``, a fork-started DataLoader worker), the copies of the pipe ends are closed
    and every call does nothing.
    """

    isolation = "process"

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """The state of a transport that has no engine process (before its first, and after
        a spare that ended before it answered)."""
        self._on_row: Callable[[Row, bool], None] | None = None
        self._drained = threading.Event()
        self._pid = os.getpid()
        self._proc: subprocess.Popen[bytes] | None = None
        self._tx: Sender | None = None
        self._rx: Receiver | None = None
        self._rows: Receiver | None = None
        """The rows the engine sends back (read without waiting: :meth:`take_rows`)."""
        self._rows_lock = threading.Lock()
        self._rows_taken_at = time.monotonic()
        """When rows were last taken (``time.monotonic()``)."""
        self._reader: threading.Thread | None = None
        self._startup: queue.Queue[Any] = queue.Queue()
        self._replies: dict[int, Any] = {}
        """Answers to :meth:`latest` and :meth:`processes`, by their ask's number."""
        self._awaited: set[int] = set()
        self._reply_ready = threading.Condition()
        self._latest_seq = 0
        self._stopped = threading.Event()
        self._final: Stopped | None = None
        self._last_stats: StatsOut | None = None
        self._stopping = False
        self._killing = False
        self._sink_names: list[str] = []
        self.marks_sent = 0
        self.died = False
        """The engine process ended without being asked to."""

    # -- start -------------------------------------------------------------------------------
    def start(self, spec: EngineSpec, on_row: Callable[[Row, bool], None],
              job: Callable[[], JobShape | None] | None = None
              ) -> tuple[RunContext, list[int]]:
        """Take the spare engine process (:func:`gpulens.transport.spawn.take`) or spawn one,
        send the spec, wait until the engine is sampling.

        ``ValueError`` for a user error found there (no such GPU, a sink that cannot open);
        :class:`SpawnFailed` when the process could not be started at all.  Whatever ends the
        wait (KeyboardInterrupt too), the process is ended and the pipes closed before it
        propagates.
        """
        laps = Laps("engine process start")
        spare = spawn.take()
        if spare is not None:
            laps.mark("spare taken")
            try:
                return self._start(spare, spec, on_row, job, laps)
            except _EndedFirst as exc:
                # it ended since it was judged good (killed?), having said nothing: a new
                # process, as below, once its link thread (which ends with it) is gone
                reader = self._reader
                if reader is not None:
                    reader.join(5.0)
                    if reader.is_alive():
                        raise
                self._close_rows()
                laps.mark("spare ended first")
                logger.warning("gpulens: the engine process made ready while training was "
                               "set up ended before it answered the monitor's start (%s); "
                               "starting a new one", exc.how)
                self._reset()
        spawned = spawn.spawn()
        laps.mark("spawned")
        return self._start(spawned, spec, on_row, job, laps)

    def _start(self, spawned: spawn.Spawned, spec: EngineSpec,
               on_row: Callable[[Row, bool], None], job: Callable[[], JobShape | None] | None,
               laps: Laps) -> tuple[RunContext, list[int]]:
        self._pid = os.getpid()
        self._on_row = on_row
        self._sink_names = [s.name for s in spec.sinks]
        try:
            tx, rx, rows = (Sender(spawned.to_child, blocking=False),
                            Receiver(spawned.from_child), Receiver(spawned.rows))
        except BaseException:
            spawned.close(0.0)
            raise
        self._proc, self._tx, self._rx, self._rows = spawned.proc, tx, rx, rows
        try:
            _LIVE.add(self)
            self._reader = threading.Thread(target=self._read_loop, name="gpulens-link",
                                            daemon=True)
            self._reader.start()
            # this moment's environment and folder (a spare was spawned with earlier ones)
            start = Start(spec if job is None else replace(spec, job=None), spawn.child_env(),
                          spawn.cwd(), job_follows=job is not None)
            if not self._tx.send(start, force=True):  # its pipe's other end is closed
                raise _EndedFirst(how_it_ended(self._proc))
            laps.mark("spec sent")
            if job is not None:  # it opens NVML and its GPUs while this waits for the others
                self._tx.send(Job(job()), force=True)
                laps.mark("the other ranks' GPUs waited for")
            try:
                got = self._startup.get(timeout=READY_TIMEOUT_S)
            except queue.Empty:
                raise SpawnFailed(f"the engine process did not start within "
                                  f"{READY_TIMEOUT_S:.0f} s") from None
            if isinstance(got, Ready):
                laps.mark("ready waited for")
                laps.say()
                return got.context, list(got.torch_indices)
            if isinstance(got, Failed) and got.user_error:
                raise ValueError(got.text)
            if isinstance(got, Failed):
                raise SpawnFailed(f"the engine process failed: {got.kind}: {got.text}")
            raise _EndedFirst(how_it_ended(self._proc))
        except BaseException:
            self._kill()
            _LIVE.discard(self)
            raise

    # -- the link thread -----------------------------------------------------------------------
    def _read_loop(self) -> None:
        rx = self._rx
        assert rx is not None
        started = False
        try:
            while True:
                msg = rx.recv()
                if isinstance(msg, RowOut):
                    on_row = self._on_row
                    if on_row is not None:
                        try:
                            on_row(msg.row, msg.final)
                        except Exception as exc:
                            warn_once("link-row", "gpulens: could not hand a row on: %r", exc)
                elif isinstance(msg, Drained):
                    self.take_rows(wait=True)  # the engine sent them before this answer
                    self._drained.set()
                elif isinstance(msg, LogOut):
                    reemit(msg.record)
                elif isinstance(msg, StatsOut):
                    self._last_stats = msg
                    if time.monotonic() - self._rows_taken_at >= STATS_EVERY_S:
                        self.take_rows()  # log() has not taken rows for a while: it stopped
                elif isinstance(msg, (LatestReply, ProcessesReply)):
                    answer = msg.values if isinstance(msg, LatestReply) else msg.processes
                    with self._reply_ready:
                        if msg.seq in self._awaited:  # else its asker gave up: drop it
                            self._replies[msg.seq] = answer
                            self._reply_ready.notify_all()
                elif isinstance(msg, Stopped):
                    self.take_rows(wait=True)  # the last ones, sent before this answer
                    self._final = msg
                    self._set_stopped()
                elif isinstance(msg, (Ready, Failed)) and not started:
                    started = isinstance(msg, Ready)
                    self._startup.put(msg)
        except LinkClosed:
            pass
        except Exception as exc:
            warn_once("link-read", "gpulens: reading from the engine process failed: %r", exc)
        finally:
            rx.close()  # this thread's to close: nothing reads it any more
            if not started:
                self._startup.put(None)
            else:
                self.take_rows(wait=True)  # whatever a dying engine got out
                if self._final is None and not self._killing:
                    self.died = True
                    how = how_it_ended(self._proc) if self._proc is not None else "gone"
                    lost = ", ".join(self._sink_names)
                    logger.warning(
                        "gpulens: the engine process ended unexpectedly (%s); GPU rows "
                        "stop, training goes on%s", how,
                        f"; rows it had not yet written to {lost} are lost (counted in "
                        "stop()'s figures)" if lost else "")
            self._set_stopped()

    def _set_stopped(self) -> None:
        with self._reply_ready:
            self._stopped.set()
            self._reply_ready.notify_all()  # latest() need not wait out its timeout

    def take_rows(self, wait: bool = False) -> None:
        """Hand on, through ``on_row``, every row the engine has sent back so far; never waits
        for the engine.  From ``log()`` on the training thread, which also never waits for
        the lock: while the link thread is taking rows, that call leaves them to it
        (``wait=True``: the link thread, and the end)."""
        rows, on_row = self._rows, self._on_row
        if rows is None or on_row is None or rows.closed:
            return
        if not self._rows_lock.acquire(blocking=wait):
            return
        try:
            self._rows_taken_at = time.monotonic()
            if rows.closed:
                return
            try:
                messages = rows.poll()
            except OSError as exc:
                warn_once("link-rows", "gpulens: reading the rows from the engine process "
                          "failed: %r", exc)
                return
            for msg in messages:
                if isinstance(msg, RowOut):
                    try:
                        on_row(msg.row, msg.final)
                    except Exception as exc:
                        warn_once("link-row", "gpulens: could not hand a row on: %r", exc)
        finally:
            self._rows_lock.release()

    def _close_rows(self) -> None:
        rows = self._rows
        if rows is not None:
            with self._rows_lock:
                rows.close()

    @property
    def pid(self) -> int | None:
        """The engine process's id (``None`` before start or in a forked child)."""
        return self._proc.pid if self._proc is not None else None

    # -- fork ----------------------------------------------------------------------------------
    @property
    def forked(self) -> bool:
        """True in a process forked from the one that started this (which alone talks to
        the engine process)."""
        return os.getpid() != self._pid

    def forget(self) -> None:
        """In a forked child: close this process's copies of the pipe ends and do nothing
        more (never send: the engine process is the parent's)."""
        tx, rx, rows = self._tx, self._rx, self._rows
        self._tx = self._rx = self._rows = None
        self._rows_lock = threading.Lock()  # the parent's may have been held at the fork
        if self._proc is not None:
            spawn.forked_away.append(self._proc)  # the parent's process: never reaped here
        self._proc = None
        if tx is not None:
            tx.abandon()
        for receiver in (rx, rows):
            if receiver is not None:
                receiver.abandon()

    # -- training thread ---------------------------------------------------------------------
    def send_mark(self, mark: MarkFields) -> bool:
        """Send a step mark (training thread; never blocks).  False if it was dropped because
        the engine did not keep up (counted by the pipe) or the engine is gone."""
        tx = self._tx
        if tx is None:  # not started, stopped, or a forked child (see forget)
            return False
        if tx.send(mark):  # a plain tuple: see gpulens.transport.messages
            self.marks_sent += 1
            return True
        if not tx.closed:
            warn_once("link-full", "gpulens: the engine process is not keeping up; step "
                      "marks are dropped (counted)")
        return False

    @property
    def dropped_marks(self) -> int:
        """Step marks dropped because the pipe's queue was full."""
        tx = self._tx
        return tx.dropped if tx is not None else 0

    @property
    def engine_dropped_marks(self) -> int:
        """Step marks the engine dropped (it warned), as it last said."""
        engine = self._final or self._last_stats
        return engine.dropped_marks if engine is not None else 0

    def finish(self, row: Row) -> None:
        """A merged row to finish (rank 0's training thread, inside ``log()``): never blocks,
        never dropped for the pipe's bound (it is not a mark: each is a row of the job)."""
        tx = self._tx
        if tx is not None:
            tx.send(Finish(row), force=True)

    def drain(self, timeout: float) -> None:
        """Ask the engine to close its last windows; wait until their rows are here."""
        tx = self._tx
        if tx is None or tx.closed or self._stopped.is_set():
            return
        tx.send(Drain(), force=True)
        deadline = time.monotonic() + timeout
        while not self._drained.wait(0.05):
            if self._stopped.is_set() or time.monotonic() > deadline:
                return
            tx.flush()
            self.take_rows()  # room in the rows pipe for what the engine still has to send

    # -- live view -----------------------------------------------------------------------------
    def latest(self, timeout: float) -> dict[str, float]:
        """The engine's newest sample of each metric (``{}`` if it does not answer in
        ``timeout`` seconds, at once if it is gone or stopping)."""
        got: dict[str, float] | None = self._ask(LatestAsk, timeout)
        return got if got is not None else {}

    def processes(self, timeout: float) -> list[GpuProcess]:
        """The processes on the engine's GPUs (``[]`` if it does not answer in ``timeout``
        seconds, at once if it is gone or stopping)."""
        got: list[GpuProcess] | None = self._ask(ProcessesAsk, timeout)
        return got if got is not None else []

    def _ask(self, make: Callable[[int], Any], timeout: float) -> Any:
        """Send ``make(seq)`` and wait for the reply with that number; ``None`` without one."""
        if self.forked:
            self.forget()
            return None
        tx = self._tx
        if tx is None or tx.closed or self._stopped.is_set() or self._stopping:
            return None
        with self._reply_ready:
            self._latest_seq += 1
            seq = self._latest_seq
            self._awaited.add(seq)
        try:
            if not tx.send(make(seq), force=True):
                return None
            deadline = time.monotonic() + timeout
            with self._reply_ready:
                while seq not in self._replies:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stopped.is_set() or self._stopping:
                        return None
                    self._reply_ready.wait(left)
                return self._replies.pop(seq)
        finally:
            with self._reply_ready:
                self._awaited.discard(seq)
                self._replies.pop(seq, None)

    # -- stop ----------------------------------------------------------------------------------
    def stop(self, timeout: float, stall: float, collective: bool = True,
             outcome: Outcome = "finished") -> dict[str, SinkStats]:
        """Send what is queued and :class:`Stop`; wait for the last rows and the sinks'
        figures.  If the engine died, the figures it last sent, with every row it had not
        written counted as dropped."""
        if self.forked:
            self.forget()
            return {}
        if self._stopping:
            return self._stats()
        self._stopping = True
        with self._reply_ready:
            self._reply_ready.notify_all()  # a latest() waiting gives up now
        deadline = time.monotonic() + timeout + STOP_GRACE_S
        tx = self._tx
        if tx is not None and not tx.closed:
            tx.send(Stop(timeout, stall, collective, outcome), force=True)
            while tx.pending_bytes and not tx.closed and time.monotonic() < deadline:
                time.sleep(0.002)
                tx.flush()
        while not self._stopped.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                logger.warning("gpulens: the engine process did not stop in %.0f s; it is "
                               "ended", timeout + STOP_GRACE_S)
                break
            self.take_rows()  # room in the rows pipe for the last rows
        if self._reader is not None:
            self._reader.join(max(0.0, deadline - time.monotonic()) + 1.0)
        self._kill(grace=max(0.5, deadline - time.monotonic()))
        _LIVE.discard(self)
        return self._stats()

    def _stats(self) -> dict[str, SinkStats]:
        if self._final is not None:
            return dict(self._final.stats)
        # The engine died (or never said): its last figures, and every mark it was sent that
        # its sinks did not account for is a row lost.
        last: Stats = dict(self._last_stats.stats) if self._last_stats is not None else {}
        out: dict[str, SinkStats] = {}
        for name in self._sink_names:
            st = last.get(name, SinkStats())
            lost = max(0, self.marks_sent - st.written - st.dropped)
            out[name] = SinkStats(written=st.written, dropped=st.dropped + lost,
                                  failures=st.failures)
            if out[name].dropped:
                logger.warning("gpulens: sink %s: %d rows written, %d dropped (the engine "
                               "process died)", name, st.written, out[name].dropped)
        return out

    def _kill(self, grace: float = 0.0) -> None:
        self._killing = True
        tx = self._tx
        if tx is not None:
            tx.close()
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5.0)
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            # the child is gone: end of file is on its way to the reader, which closes rx
            reader.join(1.0)
        if self._rx is not None and (reader is None or not reader.is_alive()):
            self._rx.close()  # once: the reader may have closed it already
        if reader is None or not reader.is_alive():
            self._close_rows()


_LIVE: weakref.WeakSet[ProcessTransport] = weakref.WeakSet()
"""Engine processes this process talks to: a forked child forgets them (see forget)."""


def _forget_all_after_fork() -> None:
    for transport in list(_LIVE):
        with contextlib.suppress(Exception):
            transport.forget()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all_after_fork)
