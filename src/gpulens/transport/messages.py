"""The one message protocol between the client (training process) and the engine.

Client -> engine: :class:`Start` (first, once), :class:`~gpulens.model.Mark` (each
``log()``), :class:`LatestAsk`, :class:`ProcessesAsk`, :class:`Finish` (a distributed job's
merged row, rank 0), :class:`Drain` (a distributed job's stop: last windows first), :class:`Stop`.

Engine -> client: :class:`Ready` or :class:`Failed` (answer to ``Start``), :class:`RowOut`
(finished rows for the client's own sinks, or raw rows for the rank gather), :class:`LogOut`
(every record of the engine's ``gpulens`` loggers, re-emitted in the client at its level),
:class:`LatestReply`, :class:`ProcessesReply`, :class:`StatsOut` (the engine's sink figures,
every second), :class:`Drained`, :class:`Stopped` (last).

Messages are named tuples.  A mark, which crosses at every ``log()``, goes down the pipe as the
plain tuple of its fields and is made a :class:`~gpulens.model.Mark` again on arrival:
pickling a plain tuple took 0.53 us here against 2.1 us for the named tuple (a third of what
``log()`` costs in all).
"""

from __future__ import annotations

from typing import NamedTuple

from gpulens.engine.spec import EngineSpec
from gpulens.log import LogPayload
from gpulens.model import JobShape, Mark, Outcome, Row, RunContext, SinkStats
from gpulens.sources.processes import GpuProcess

__all__ = ["Drain", "Drained", "Failed", "Finish", "Job", "LatestAsk", "LatestReply", "LogOut",
           "Mark", "ProcessesAsk", "ProcessesReply", "Ready", "RowOut", "Start", "Stats",
           "StatsOut", "Stop", "Stopped"]

Stats = dict[str, SinkStats]


class Start(NamedTuple):
    spec: EngineSpec
    env: dict[str, str]
    """The environment to build the engine in: the training process's at its start (a spare
    was spawned earlier, with the environment of then)."""
    cwd: str | None
    """The same for the working folder (``None``: removed; the engine keeps its own)."""
    job_follows: bool = False
    """The job's shape comes next (a :class:`Job`; ``spec.job`` is ``None``): the client
    waits for the other ranks while the engine opens NVML and its GPUs."""


class Job(NamedTuple):
    """The job's shape, right after a ``Start`` that says ``job_follows``."""

    shape: JobShape | None


class LatestAsk(NamedTuple):
    seq: int


class ProcessesAsk(NamedTuple):
    seq: int


class Finish(NamedTuple):
    row: Row


class Drain(NamedTuple):
    pass


class Drained(NamedTuple):
    pass


class Stop(NamedTuple):
    timeout: float
    """Seconds the engine may spend writing what its sinks hold."""
    stall: float
    """Seconds without progress after which it gives up on a sink."""
    collective: bool = True
    """Where the engine gathers: its last rows meet the other ranks' (False: an exception
    path, no wait for them)."""
    outcome: Outcome = "finished"
    """How training ended (:data:`~gpulens.model.Outcome`), for sinks that end runs."""


class Ready(NamedTuple):
    context: RunContext
    torch_indices: list[int]


class Failed(NamedTuple):
    user_error: bool
    """A ``ValueError`` (raise it in the client) rather than a fault (fall back)."""
    kind: str
    text: str


class RowOut(NamedTuple):
    row: Row
    final: bool
    """Finished (for the client's sinks), or a raw window of a distributed job."""


class LogOut(NamedTuple):
    record: LogPayload


class LatestReply(NamedTuple):
    seq: int
    values: dict[str, float]


class ProcessesReply(NamedTuple):
    seq: int
    processes: list[GpuProcess]


class StatsOut(NamedTuple):
    stats: Stats
    dropped_marks: int


class Stopped(NamedTuple):
    stats: Stats
    dropped_marks: int
