"""The per-sink writer (the step logger): hands finished rows to the sinks without ever blocking
training.  It is sink machinery, used by the engine (the sinks it writes) and by the client (the
sinks written in the training process).

Each sink gets its own worker thread and a bounded buffer, so a slow or unreachable tracker
(an MLflow server that went away) holds up nobody else.  The worker **opens** its sink first:
a tracker library takes seconds to import and a run seconds to make, none of it on the thread
that starts the monitor; rows buffer meanwhile.  A failed write is retried with back-off (0.5
s doubling to 10 s); when the buffer is full the oldest row is dropped and counted.  Sinks
whose ``on_training_thread`` attribute is true (a framework's own loggers, which are not made
for a second thread) are opened at :meth:`StepLogger.open` and written from the training
thread, inside the next ``log()`` or ``stop()``.

What users hear (WARNING, through the ``gpulens`` logger, once per cause), each naming the sink
as the user wrote it (``jsonl:/dev/full``): a sink that could not open (its rows are dropped,
counted), a sink whose writes fail (rows are kept and retried; said at the first failure), a
sink more than :data:`SLOW_BACKLOG_ROWS` rows or :data:`SLOW_BACKLOG_S` seconds behind (a
slow tracker), a full buffer (rows dropped), what ``close`` waits for once it has waited
:data:`TELL_AFTER_S`, and at the end every sink that dropped rows: one line with the counts
and why.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import replace

from gpulens.log import logger, one_line, warn_once
from gpulens.model import Outcome, Row, RunContext, SinkStats
from gpulens.sinks import SinkSpec, unique_names
from gpulens.sinks.base import EndsRun, Sink

TRAINING_THREAD_ROWS_PER_LOG = 2
STOP_TIMEOUT_S = 120.0
"""How long ``close`` (``Monitor.stop``) waits at most for the sinks to write what they hold:
a slow MLflow server takes ~20-50 ms a row, so thousands of buffered rows fit."""
STALL_S = 20.0
"""``close`` gives up on a sink that wrote nothing for this long (a tracker that hangs)."""
CLOSE_RETRIES = 2
"""``close`` gives up on a sink whose writes fail after this many more failed attempts (a full
disk, a tracker that refuses): failing is not progress."""
CLOSE_BACKOFF_S = 0.25
"""The first pause between those attempts (doubling)."""
TELL_AFTER_S = 3.0
"""``close`` says what it is waiting for once it has waited this long, then every 10 s."""
ROWS_PER_CALL = 100
"""At most this many waiting rows are handed at once to a sink with ``write_rows(rows)`` (which
writes a leading part of them in one call and returns how many it wrote): MLflow's
``log_batch`` costs about as much for 100 rows as for one."""
SLOW_BACKLOG_ROWS = 200
SLOW_BACKLOG_S = 30.0
"""A sink this many rows or seconds behind is a slow tracker: warned about once."""


class _Delivery:
    """A sink, its bounded buffer and (unless on the training thread) its worker thread, which
    builds the sink (given as a :class:`~gpulens.sinks.SinkSpec`: its module is imported
    there) and opens it, then writes it."""

    def __init__(self, sink: Sink | SinkSpec, name: str, capacity: int) -> None:
        self._spec = sink if isinstance(sink, SinkSpec) else None
        self.sink: Sink | None = None if isinstance(sink, SinkSpec) else sink
        self.name = name
        self.on_training_thread = bool(getattr(self.sink, "on_training_thread", False))
        self.capacity = capacity
        self.buffer: deque[tuple[Row, float]] = deque()
        self.stats = SinkStats()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self.abandoned = False
        self.opened = False
        self.why: str | None = None
        """Why rows were given up on (said with the counts at the end)."""
        self.close_failures = 0
        """Writes that failed since ``close`` began."""
        self._thread: threading.Thread | None = None
        self._retry_at = 0.0
        self._backoff = 0.0

    def start(self, context: RunContext) -> None:
        """Open here (a training-thread sink: ``ValueError`` if it cannot), or start the
        worker, which opens it."""
        if self.on_training_thread:
            assert self.sink is not None
            open_sink(self.sink, self.name, context)
            self.opened = True
            return
        self._thread = threading.Thread(
            target=self._run, args=(context,), name=f"gpulens-sink-{self.name}", daemon=True
        )
        self._thread.start()

    def put(self, row: Row) -> None:
        now = time.monotonic()
        with self._lock:
            if self.abandoned:
                self.stats.dropped += 1
                return
            if len(self.buffer) >= self.capacity:
                self.buffer.popleft()
                self.stats.dropped += 1
                warn_once(f"full:{self.name}",
                          "gpulens: sink %s is behind; its buffer of %d rows is full and the "
                          "oldest rows are dropped (counted)", self.name, self.capacity)
            self.buffer.append((row, now))
            backlog = len(self.buffer)
            oldest = now - self.buffer[0][1]
        if backlog > SLOW_BACKLOG_ROWS or oldest > SLOW_BACKLOG_S:
            warn_once(f"slow:{self.name}",
                      "gpulens: sink %s is slow: %d rows waiting, the oldest for %.0f s "
                      "(rows are kept up to %d, then the oldest are dropped)", self.name,
                      backlog, oldest, self.capacity)
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self.buffer)

    def deliver(self, deadline: float | None = None, limit: int | None = None) -> bool:
        """Write what is buffered, oldest first (at most ``limit`` rows).  False if a write
        failed (rows kept) or rows are left."""
        if time.monotonic() < self._retry_at or not self.opened:
            return False
        sink = self.sink
        assert sink is not None
        written = 0
        while self.buffer and not self.abandoned:
            if deadline is not None and time.monotonic() > deadline:
                return False
            if limit is not None and written >= limit:
                return False
            write_rows = getattr(sink, "write_rows", None)
            if write_rows is not None and len(self.buffer) > 1 and limit is None:
                # a backlog: a sink that can (MLflow) writes several rows in one call
                rows = [self.buffer[i][0] for i in range(min(len(self.buffer), ROWS_PER_CALL))]
            else:
                rows = [self.buffer[0][0]]
            try:
                if len(rows) > 1:
                    rows = rows[:max(1, int(write_rows(rows)))]  # type: ignore[misc]
                else:
                    sink.write(rows[0])
            except Exception as exc:
                self._failed(exc)
                return False
            with self._lock:
                for row in rows:
                    if self.buffer and self.buffer[0][0] is row:  # not dropped meanwhile
                        self.buffer.popleft()
                self.stats.written += len(rows)
            written += len(rows)
            self._backoff = 0.0
            self.why = None  # it writes again
        return not self.buffer

    def _failed(self, exc: Exception) -> None:
        """A write failed: said once (at once), retried after a back-off; at close, a few
        more tries (:data:`CLOSE_RETRIES`), then given up (see :meth:`StepLogger.close`)."""
        self.stats.failures += 1
        self.why = f"its writes failed: {one_line(exc)}"
        if self._closing.is_set():
            self.close_failures += 1
            self._backoff = CLOSE_BACKOFF_S if self._backoff <= 0 else self._backoff * 2
        else:
            self._backoff = min(10.0, max(0.5, self._backoff * 2))
        self._retry_at = time.monotonic() + self._backoff
        if self._closing.is_set():
            warn_once(f"write:{self.name}",
                      "gpulens: sink %s failed to write at stop (%s); tried again at most %d "
                      "times, then its rows are dropped (counted)", self.name, one_line(exc),
                      CLOSE_RETRIES)
        else:
            warn_once(f"write:{self.name}",
                      "gpulens: sink %s failed to write (%s); rows are kept (up to %d) and "
                      "retried", self.name, one_line(exc), self.capacity)

    def _run(self, context: RunContext) -> None:
        try:
            if self._spec is not None:
                self.sink = self._spec.build()
            assert self.sink is not None
            self.sink.open(context)
        except Exception as exc:
            self.why = f"it could not open: {one_line(exc)}"
            logger.warning("gpulens: sink %s could not open (%s); its rows are dropped "
                           "(counted)", self.name, one_line(exc))
            self.abandon()
            return
        self.opened = True
        while not self.abandoned:
            if self._closing.is_set() and not self.buffer:
                return
            self._wake.wait(0.5 if not self._closing.is_set() else 0.05)
            self._wake.clear()
            self.deliver()

    def begin_close(self) -> None:
        self._closing.set()
        if self._backoff > 0:  # a sink that was failing: try again now
            self._backoff = 0.0
            self._retry_at = 0.0
        self._wake.set()

    @property
    def busy(self) -> bool:
        """Rows are left, or the worker is still opening the sink or inside a write."""
        if self.abandoned:
            return False
        if self.buffer:
            return True
        return self._thread is not None and self._thread.is_alive()

    def abandon(self) -> int:
        """Give up: count what is buffered as dropped (a worker stuck in a write is left to
        finish or fail on its own).  Returns the rows dropped."""
        with self._lock:
            self.abandoned = True
            lost = len(self.buffer)
            self.stats.dropped += lost
            self.buffer.clear()
        self._wake.set()
        return lost

    def count_lost(self) -> None:
        """Rows the sink took but says it lost move from written to dropped: its ``rows_lost``
        (a W&B run that stopped answering, rows overwritten in W&B) and its ``rows_waiting``,
        rows still waiting in it for a W&B record when it was given up before it closed."""
        lost = getattr(self.sink, "rows_lost", 0)
        waiting = getattr(self.sink, "rows_waiting", 0)
        lost = lost if isinstance(lost, int) and lost > 0 else 0
        waiting = waiting if isinstance(waiting, int) and waiting > 0 else 0
        if not lost + waiting:
            return
        with self._lock:
            moved = min(lost + waiting, self.stats.written)
            self.stats.written -= moved
            self.stats.dropped += moved
        because = (getattr(self.sink, "lost_why", None) if lost else None) or \
            "they waited in the sink when its run stopped answering"
        if waiting:
            because = ("they waited in the sink for a W&B record when it was given up (a run "
                       "finished before the monitor stopped gives none)")
        self.why = because if self.why is None else f"{self.why}; {moved} because {because}"

    def close_sink(self, outcome: Outcome = "finished") -> None:
        sink = self.sink
        if sink is None or not self.opened or (self._thread is not None and
                                               self._thread.is_alive()):
            return  # never opened; or still inside a write: never close a sink under it
        try:
            if isinstance(sink, EndsRun):
                sink.end_run_as(outcome)
            sink.close()
        except Exception as exc:
            if self.stats.failures:
                return  # the cause its writes failed of, told already
            warn_once(f"close:{self.name}", "gpulens: closing sink %s failed: %s", self.name,
                      one_line(exc))


def open_sink(sink: Sink, name: str, context: RunContext) -> None:
    """``sink.open(context)``; any failure as a one-line ``ValueError`` naming the sink
    (its own words for a user error)."""
    try:
        sink.open(context)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"sink {name} could not open: {one_line(exc)}") from exc


class StepLogger:
    """Fans rows out to sinks (see module doc)."""

    def __init__(self, sinks: list[Sink | SinkSpec], *, names: list[str] | None = None,
                 buffer_rows: int = 10_000) -> None:
        names = names if names is not None else unique_names(sinks)
        self._deliveries = [_Delivery(s, n, buffer_rows) for s, n in zip(sinks, names,
                                                                          strict=True)]
        self._training = [d for d in self._deliveries if d.on_training_thread]

    @property
    def names(self) -> list[str]:
        return [d.name for d in self._deliveries]

    def open(self, context: RunContext) -> None:
        """Open the training-thread sinks here (a sink that cannot open is a user error:
        ``ValueError`` naming it, after the others are closed again) and start every other
        sink's worker, which opens it off this thread: a failure there is a WARNING, and that
        sink's rows are counted as dropped."""
        opened: list[_Delivery] = []
        try:
            for d in self._training:
                d.start(context)
                opened.append(d)
        except Exception:
            for d in opened:
                with contextlib.suppress(Exception):
                    d.sink.close()  # type: ignore[union-attr]
            raise
        for d in self._deliveries:
            if not d.on_training_thread:
                d.start(context)

    def submit(self, row: Row) -> None:
        """Queue a row for every sink (called from the sampler or link thread)."""
        for d in self._deliveries:
            d.put(row)

    def drain_training_thread(self) -> None:
        """Write queued rows to the training-thread sinks (called inside ``log()``).

        Rows are finished in bursts; writing a whole burst inside one ``log()`` would make that
        one step slow (``wandb.log`` costs milliseconds).  At most
        ``TRAINING_THREAD_ROWS_PER_LOG`` rows go out per call: more than one row per ``log()``
        on average, so the backlog drains, and ``close()`` writes the rest.
        """
        for d in self._training:
            if d.buffer:
                d.deliver(limit=TRAINING_THREAD_ROWS_PER_LOG)

    def stats(self) -> dict[str, SinkStats]:
        """A copy of every sink's figures so far."""
        return {d.name: replace(d.stats) for d in self._deliveries}

    def pending(self) -> dict[str, int]:
        """Rows each sink still holds."""
        return {d.name: d.pending for d in self._deliveries}

    def close(self, timeout: float = STOP_TIMEOUT_S, stall: float = STALL_S,
              outcome: Outcome = "finished") -> dict[str, SinkStats]:
        """Write what the sinks hold, close them, report what was dropped.  A sink that ends a
        run of its own (:class:`~gpulens.sinks.base.EndsRun`) is told ``outcome`` first.

        Waits while sinks make progress: at most ``timeout`` seconds in all, and gives up on a
        sink that wrote nothing for ``stall`` seconds.  After :data:`TELL_AFTER_S` it says what
        it waits for.  Training-thread sinks are written here (call it on the training thread).
        """
        start = time.monotonic()
        deadline = start + max(0.0, timeout)
        for d in self._deliveries:
            d.begin_close()
        progress = {d.name: (d.stats.written, start) for d in self._deliveries}
        tell_at = start + TELL_AFTER_S
        while True:
            now = time.monotonic()
            for d in self._training:
                if d.buffer and not d.abandoned:
                    d.deliver(deadline=min(deadline, now + 0.5))
            busy = [d for d in self._deliveries if d.busy]
            if not busy:
                break
            now = time.monotonic()
            for d in busy:
                written, since = progress[d.name]
                if d.stats.written != written:
                    progress[d.name] = (d.stats.written, now)
                elif d.close_failures >= CLOSE_RETRIES:
                    d.abandon()  # why: its writes failed (d.why)
                elif now - since > stall or now > deadline:
                    d.why = "its time was up at stop" if now > deadline else \
                        f"it wrote nothing for {stall:.0f} s at stop"
                    d.abandon()
            if now >= tell_at:
                waiting = ", ".join(
                    f"{d.name} ({d.pending} rows left, {d.stats.written} written"
                    f"{'' if d.opened else ', still opening'})"
                    for d in busy if not d.abandoned)
                if waiting:
                    logger.warning("gpulens: stop() is waiting for %s: %.0f s so far, at most "
                                   "%.0f s, or %.0f s without progress", waiting, now - start,
                                   timeout, stall)
                tell_at = now + 10.0
            time.sleep(0.01)
        for d in self._deliveries:
            d.close_sink(outcome)
            d.count_lost()
        stats = self.stats()
        for d in self._deliveries:
            st = stats[d.name]
            if st.dropped:
                logger.warning("gpulens: sink %s: %d rows written, %d dropped (%s)", d.name,
                               st.written, st.dropped,
                               d.why or f"its buffer was full; {st.failures} failed writes")
        return stats
