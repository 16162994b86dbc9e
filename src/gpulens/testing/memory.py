"""A sink that keeps every row in memory (for tests and notebooks)."""

from __future__ import annotations

import threading

from gpulens.model import Row, RunContext


class MemorySink:
    """Keeps rows in ``rows``; ``fail`` makes ``write`` raise (to test retries)."""

    def __init__(self, *, on_training_thread: bool = False) -> None:
        self.rows: list[Row] = []
        self.context: RunContext | None = None
        self.closed = False
        self.fail = False
        self.on_training_thread = on_training_thread
        self.write_threads: set[str] = set()
        self._lock = threading.Lock()

    def open(self, context: RunContext) -> None:
        self.context = context

    def write(self, row: Row) -> None:
        if self.fail:
            raise ConnectionError("MemorySink told to fail")
        with self._lock:
            self.rows.append(row)
            self.write_threads.add(threading.current_thread().name)

    def close(self) -> None:
        self.closed = True
