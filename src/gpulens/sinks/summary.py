"""A sink that folds rows into a run summary (per-GPU activity, memory, power, temperature,
energy, throttling), for ``gpulens record`` and anyone who wants the figures in code::

    summary = SummarySink()
    with gpulens.Monitor(sinks=[summary]) as mon:
        ...
    print(summary.result().to_dict())

Constant memory: rows are folded as they come (see :mod:`gpulens.report.summary`).
"""

from __future__ import annotations

import threading
import time

from gpulens.model import Row, RunContext
from gpulens.report.summary import RunSummary, SummaryBuilder


class SummarySink:
    """Keeps a :class:`~gpulens.report.summary.SummaryBuilder` fed with every row."""

    on_training_thread = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._builder: SummaryBuilder | None = None
        self.context: RunContext | None = None

    @classmethod
    def from_spec(cls, arg: str | None) -> SummarySink:
        """The summary sink takes no argument."""
        if arg:
            raise ValueError("the summary sink takes no argument")
        return cls()

    def open(self, context: RunContext) -> None:
        """Start a new summary; GPU names, memory totals and the backend (``"simulated"`` is
        said in the summary's headline) come from ``context``."""
        with self._lock:
            self.context = context
            self._builder = SummaryBuilder(
                gpu_names={str(g.index): g.name for g in context.gpus},
                mem_total_gb={str(g.index): g.mem_total_gb for g in context.gpus
                              if g.mem_total_gb},
                start_time=time.time(),
                backend=context.backend,
            )

    def write(self, row: Row) -> None:
        with self._lock:
            if self._builder is None:
                raise RuntimeError("SummarySink.write before open")
            self._builder.add(row.step, row.time, row.values)

    def close(self) -> None:
        """Nothing to release; the summary stays readable."""

    def result(self, work: float | None = None, unit: str = "units") -> RunSummary:
        """The summary of the rows so far (``work`` adds efficiency per joule and per watt)."""
        with self._lock:
            if self._builder is None:
                return RunSummary()
            return self._builder.result(work=work, unit=unit)
