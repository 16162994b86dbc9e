"""The step logger: hands finished rows to the sinks without ever blocking training.

Each sink gets its own worker thread and a bounded buffer, so a slow or unreachable tracker
(an MLflow server that went away) holds up nobody else.  A failed write is retried with
back-off; when the buffer is full the oldest row is dropped and counted.  Sinks whose
``on_training_thread`` attribute is true (W&B: ``wandb.log`` is not thread-safe) are written
from the training thread, inside the next ``log()`` or ``stop()``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass

from gpulens._warn import logger, warn_once
from gpulens.sinks.base import Row, RunContext, Sink

TRAINING_THREAD_ROWS_PER_LOG = 2


@dataclass
class SinkStats:
    """What happened to the rows of one sink."""

    written: int = 0
    dropped: int = 0
    """Rows dropped because the buffer was full or the sink still failed at stop()."""
    failures: int = 0
    """Failed write attempts (each retried)."""


def sink_name(sink: Sink) -> str:
    return type(sink).__name__


class _Delivery:
    """A sink, its bounded buffer and (unless on the training thread) its worker thread."""

    def __init__(self, sink: Sink, capacity: int) -> None:
        self.sink = sink
        self.name = sink_name(sink)
        self.on_training_thread = bool(getattr(sink, "on_training_thread", False))
        self.capacity = capacity
        self.buffer: deque[Row] = deque()
        self.stats = SinkStats()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._retry_at = 0.0
        self._backoff = 0.0

    def start(self) -> None:
        if not self.on_training_thread:
            self._thread = threading.Thread(
                target=self._run, name=f"gpulens-sink-{self.name}", daemon=True
            )
            self._thread.start()

    def put(self, row: Row) -> None:
        with self._lock:
            if len(self.buffer) >= self.capacity:
                self.buffer.popleft()
                self.stats.dropped += 1
                warn_once(f"full:{self.name}",
                          "gpulens: sink %s is behind; its buffer of %d rows is full and the "
                          "oldest rows are dropped (counted)", self.name, self.capacity)
            self.buffer.append(row)
        self._wake.set()

    def deliver(self, deadline: float | None = None, limit: int | None = None) -> bool:
        """Write what is buffered, oldest first (at most ``limit`` rows).  False if a write
        failed (rows kept) or rows are left."""
        if time.monotonic() < self._retry_at and not self._closing.is_set():
            return False
        written = 0
        while self.buffer:
            if deadline is not None and time.monotonic() > deadline:
                return False
            if limit is not None and written >= limit:
                return False
            row = self.buffer[0]
            try:
                self.sink.write(row)
            except Exception as exc:
                self.stats.failures += 1
                self._backoff = min(10.0, max(0.5, self._backoff * 2))
                self._retry_at = time.monotonic() + self._backoff
                warn_once(f"write:{self.name}",
                          "gpulens: sink %s failed to write (%r); rows are buffered (up to %d) "
                          "and retried", self.name, exc, self.capacity)
                return False
            with self._lock:
                if self.buffer and self.buffer[0] is row:  # not dropped meanwhile (buffer full)
                    self.buffer.popleft()
            self.stats.written += 1
            written += 1
            self._backoff = 0.0
        return True

    def _run(self) -> None:
        while not self._closing.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            self.deliver()

    def begin_close(self) -> None:
        self._closing.set()
        self._wake.set()

    def close(self, deadline: float) -> None:
        self.begin_close()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                # The worker is stuck inside a write (a network timeout); leave it, count.
                with self._lock:
                    self.stats.dropped += len(self.buffer)
                    self.buffer.clear()
                return
        self._retry_at = 0.0
        if not self.deliver(max(deadline, time.monotonic() + 0.5)):
            with self._lock:
                self.stats.dropped += len(self.buffer)
                self.buffer.clear()
        try:
            self.sink.close()
        except Exception as exc:
            warn_once(f"close:{self.name}", "gpulens: closing sink %s failed: %r", self.name, exc)


class StepLogger:
    """Fans rows out to sinks (see module doc)."""

    def __init__(self, sinks: list[Sink], *, buffer_rows: int = 10_000) -> None:
        self._deliveries = [_Delivery(s, buffer_rows) for s in sinks]
        seen: dict[str, int] = {}
        for d in self._deliveries:  # unique names: "MemorySink", "MemorySink#2", ...
            seen[d.name] = seen.get(d.name, 0) + 1
            if seen[d.name] > 1:
                d.name = f"{d.name}#{seen[d.name]}"
        self._training = [d for d in self._deliveries if d.on_training_thread]

    def open(self, context: RunContext) -> None:
        """Open every sink; a sink's ``ValueError`` propagates (a user error) after cleanup."""
        opened: list[_Delivery] = []
        try:
            for d in self._deliveries:
                d.sink.open(context)
                opened.append(d)
        except Exception:
            for d in opened:
                with contextlib.suppress(Exception):
                    d.sink.close()
            raise
        for d in self._deliveries:
            d.start()

    def submit(self, row: Row) -> None:
        """Queue a row for every sink (called from the sampler thread)."""
        for d in self._deliveries:
            d.put(row)

    def drain_training_thread(self) -> None:
        """Write queued rows to the training-thread sinks (called inside ``log()``).

        Rows are finished in bursts (after each slow read); writing a whole burst inside one
        ``log()`` would make that one step slow (``wandb.log`` costs milliseconds).  At most
        ``TRAINING_THREAD_ROWS_PER_LOG`` rows go out per call: more than one row per ``log()``
        on average, so the backlog drains, and ``stop()`` writes the rest.
        """
        for d in self._training:
            if d.buffer:
                d.deliver(limit=TRAINING_THREAD_ROWS_PER_LOG)

    def close(self, timeout: float = 10.0) -> dict[str, SinkStats]:
        """Flush within ``timeout`` seconds, close the sinks, report what was dropped."""
        deadline = time.monotonic() + timeout
        for d in self._deliveries:
            d.begin_close()
        for d in self._deliveries:
            d.close(deadline)
        stats = {d.name: d.stats for d in self._deliveries}
        for name, st in stats.items():
            if st.dropped:
                logger.warning("gpulens: sink %s: %d rows written, %d dropped (%d failed "
                               "writes)", name, st.written, st.dropped, st.failures)
        return stats
