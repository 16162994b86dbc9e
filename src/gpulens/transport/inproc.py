"""The engine in a thread of the training process: the fallback where no process of gpulens's
own can be started (or where ``isolation="thread"`` asks for it).

Same engine, same calls, no pipe: a mark is appended to the sampler's queue, ``latest`` reads
the sampler's series, rows reach the client from the sampler thread.  What it costs: the
sampler thread and the engine's sink threads share the training process's GIL.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from gpulens.engine.engine import Engine
from gpulens.engine.spec import EngineSpec
from gpulens.model import JobShape, Mark, MarkFields, Outcome, Row, RunContext, SinkStats
from gpulens.sources.processes import GpuProcess


class InprocTransport:
    """:class:`~gpulens.transport.base.Transport` over an engine in this process."""

    isolation = "thread"

    def __init__(self) -> None:
        self._engine: Engine | None = None
        self._pid = os.getpid()

    def start(self, spec: EngineSpec, on_row: Callable[[Row, bool], None],
              job: Callable[[], JobShape | None] | None = None
              ) -> tuple[RunContext, list[int]]:
        self._pid = os.getpid()
        engine = Engine(spec, on_row=on_row)
        started = engine.start(late_job=job)
        self._engine = engine
        return started

    def take_rows(self) -> None:
        """Nothing to do: the engine thread hands its rows on itself."""

    def send_mark(self, mark: MarkFields) -> bool:
        engine = self._engine
        if engine is None:
            return False
        engine.mark(Mark(*mark))
        return True

    def finish(self, row: Row) -> None:
        engine = self._engine
        if engine is not None:
            engine.finish(row)

    def drain(self, timeout: float) -> None:
        engine = self._engine
        if engine is not None:
            engine.drain()

    def latest(self, timeout: float) -> dict[str, float]:
        engine = self._engine
        return engine.latest() if engine is not None else {}

    def processes(self, timeout: float) -> list[GpuProcess]:
        engine = self._engine
        return engine.processes() if engine is not None else []

    def stop(self, timeout: float, stall: float, collective: bool = True,
             outcome: Outcome = "finished") -> dict[str, SinkStats]:
        engine, self._engine = self._engine, None
        if engine is None:
            return {}
        self._engine_dropped = engine.dropped_marks
        return engine.stop(timeout, stall, collective, outcome)

    dropped_marks = 0
    """Nothing is dropped on the way: a mark is appended to the engine's queue."""

    @property
    def engine_dropped_marks(self) -> int:
        engine = self._engine
        return engine.dropped_marks if engine is not None else self._engine_dropped

    _engine_dropped = 0

    @property
    def forked(self) -> bool:
        return os.getpid() != self._pid

    def forget(self) -> None:
        """In a forked child: the engine's threads did not survive the fork; let it be."""
        self._engine = None
