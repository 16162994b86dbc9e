"""What every transport offers the client (:class:`Transport`), and its one fault."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gpulens.engine.spec import EngineSpec
from gpulens.model import JobShape, MarkFields, Outcome, Row, RunContext, SinkStats
from gpulens.sources.processes import GpuProcess


class SpawnFailed(Exception):
    """The engine could not be started where asked (not a user error: fall back)."""


class Transport(Protocol):
    """Carries the client's calls to an engine and the engine's rows back."""

    isolation: str
    """``"process"`` or ``"thread"``."""

    def start(self, spec: EngineSpec, on_row: Callable[[Row, bool], None],
              job: Callable[[], JobShape | None] | None = None
              ) -> tuple[RunContext, list[int]]:
        """Start the engine; ``ValueError`` for a user error, :class:`SpawnFailed` for a
        fault.  ``on_row(row, final)`` gets each row the engine hands back: finished rows
        (``spec.rows_back``), or a distributed job's raw rows (``spec.gather``).  ``job``:
        gives ``spec.job`` (it waits for the other ranks), called while the engine starts."""

    def take_rows(self) -> None:
        """Hand on, through ``on_row``, the rows the engine has sent back so far, without
        waiting (``log()`` calls it on the training thread)."""

    def finish(self, row: Row) -> None:
        """A distributed job's merged row (rank 0), for the engine to finish and write."""

    def drain(self, timeout: float) -> None:
        """A distributed job's stop, first half: the engine closes its last windows (their raw
        rows come back) and keeps its sinks open for the merged rows still to come."""

    def send_mark(self, mark: MarkFields) -> bool:
        """Hand a step mark (its fields) on without blocking; False if it was dropped
        (counted)."""

    def latest(self, timeout: float) -> dict[str, float]:
        """The engine's newest sample of each metric (``{}`` if it cannot answer)."""

    def processes(self, timeout: float) -> list[GpuProcess]:
        """The processes on the engine's GPUs (``[]`` if it cannot answer)."""

    def stop(self, timeout: float, stall: float, collective: bool = True,
             outcome: Outcome = "finished") -> dict[str, SinkStats]:
        """Stop the engine; the figures of the sinks it wrote.  ``collective``: where the
        engine gathers, its last rows meet the other ranks' (False: no wait for them);
        ``outcome``: how training ended, for the sinks that end runs of their own."""

    @property
    def dropped_marks(self) -> int:
        """Marks this transport dropped on their way (the engine did not keep up)."""

    @property
    def engine_dropped_marks(self) -> int:
        """Marks the engine dropped (too many waited for their rows); it warns about them."""

    @property
    def forked(self) -> bool:
        """True in a process forked from the one that started it (which alone owns it)."""

    def forget(self) -> None:
        """In a forked child: let go of the engine without touching it."""
