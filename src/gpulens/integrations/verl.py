"""GPU rows merged into a trainer's own tracking call, verl style.

Trainers such as verl's ``RayPPOTrainer`` log once per step through their own tracking object::

    logger.log(data=metrics, step=global_step)   # -> wandb.log(data, step=step), mlflow, console

A second writer to the same W&B run would have to log on its own W&B step (W&B's step is the
trainer's ``global_step`` there) and would push it. :class:`MergingLogger` instead puts the GPU
keys *into that same call*: it wraps the tracking object, ends the GPU window at each ``log``
and forwards ``data`` together with the GPU row of the same step::

    from gpulens.integrations.verl import MergingLogger

    logger = MergingLogger.from_config(Tracking(...), config)   # off unless the config says so
    for step in ...:
        logger.log(data=metrics, step=step)
    logger.close()

Rows are finished by the monitor's sampler a little after the step ends (up to about
``max(1 s, interval) + 0.2 s``: the window needs the data that covers it), so each call reaches
the wrapped logger once its row is ready, at a later ``log`` call or at ``close``; calls keep their
order and each step is logged exactly once. A row that has not come after ``max_delay_s`` is
given up on: the call goes out without GPU keys (counted in ``rows_missing``).

In verl the training loop runs in the driver process, which sees every GPU of its node, so the
driver's monitor (``gpus=None``) watches the node's GPUs while Ray workers train on them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gpulens.schema import STEP_KEY
from gpulens.sinks.base import Row, RunContext, Sink

__all__ = ["MergingLogger", "RowHandoff", "TrackingLogger"]


class TrackingLogger(Protocol):
    """What :class:`MergingLogger` wraps: verl's ``Tracking`` and anything alike."""

    def log(self, data: dict[str, Any], step: int) -> None: ...


class RowHandoff:
    """A sink that keeps finished rows for the training loop to pick up with :meth:`take`.

    Written on the training thread (inside ``Monitor.log``/``stop``), so no lock is needed.
    ``train/*`` keys are dropped by default: the trainer logs its own scalars.
    """

    on_training_thread = True

    def __init__(self, *, include_train: bool = False) -> None:
        self.include_train = include_train
        self._rows: dict[int, dict[str, float]] = {}

    def open(self, context: RunContext) -> None:
        pass

    def write(self, row: Row) -> None:
        values = {
            k: v for k, v in row.values.items()
            if k != STEP_KEY and (self.include_train or not k.startswith("train/"))
        }
        self._rows[row.step] = values

    def close(self) -> None:
        pass

    def take(self, step: int) -> dict[str, float] | None:
        """The row of ``step`` (removed), or ``None`` if it has not been finished yet."""
        return self._rows.pop(step, None)

    def discard_through(self, step: int) -> None:
        """Forget rows of steps up to ``step`` (they can no longer be merged anywhere)."""
        for s in [s for s in self._rows if s <= step]:
            del self._rows[s]


class MergingLogger:
    """Wraps a tracking logger so that each ``log(data, step)`` also carries the GPU keys of
    that step (see the module docstring).

    Args:
        logger: the trainer's tracking object (``log(data, step)``).
        monitor: a :class:`gpulens.Monitor` (started here if it is not running) whose sinks
            include ``handoff``; ``None``: calls pass straight through.
        handoff: the :class:`RowHandoff` given to ``monitor``.
        max_delay_s: the longest a call waits for its row before it goes out without one.
    """

    def __init__(self, logger: TrackingLogger, monitor: Any, handoff: RowHandoff | None = None,
                 *, max_delay_s: float = 10.0) -> None:
        if monitor is not None and (handoff is None or not _has_sink(monitor, handoff)):
            raise ValueError("MergingLogger: pass the RowHandoff that is among the monitor's "
                             "sinks (or build both with MergingLogger.from_config)")
        if not max_delay_s > 0:
            raise ValueError(f"max_delay_s must be > 0 seconds, got {max_delay_s!r}")
        self.logger = logger
        self.monitor = monitor
        self.handoff = handoff
        self.max_delay_s = float(max_delay_s)
        self.rows_missing = 0
        """Calls that went out without GPU keys because their row never came."""
        self._pending: deque[tuple[int, dict[str, Any], float]] = deque()
        if monitor is not None and not monitor.running:
            monitor.start()

    @classmethod
    def from_config(cls, logger: TrackingLogger, cfg: Any, *,
                    sinks: Sequence[str | Sink] = (), max_delay_s: float = 10.0) -> MergingLogger:
        """Wrap ``logger``; GPU monitoring as :func:`gpulens.from_config` reads it from ``cfg``
        (off: calls pass straight through)."""
        from gpulens.integrations.hydra import from_config

        handoff = RowHandoff()
        monitor = from_config(cfg, sinks=[handoff, *sinks])
        return cls(logger, monitor, handoff if monitor is not None else None,
                   max_delay_s=max_delay_s)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """End the GPU window at ``step`` and forward ``data`` (with the GPU keys of ``step``)
        to the wrapped logger once that row is finished.

        Meant for the single process that owns the tracking logger (verl's driver); in a
        ``torchrun`` job use a framework callback or ``Monitor.log`` on every rank instead."""
        if self.monitor is None:
            self.logger.log(data=dict(data), step=step)
            return
        self.monitor.log(step)
        self._pending.append((int(step), dict(data), time.monotonic()))
        self._forward(final=False)

    def close(self) -> None:
        """Stop the monitor (every row is finished) and forward every call still waiting."""
        if self.monitor is None:
            return
        self.monitor.stop()
        self._forward(final=True)

    def __enter__(self) -> MergingLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _forward(self, *, final: bool) -> None:
        assert self.handoff is not None
        now = time.monotonic()
        while self._pending:
            step, data, since = self._pending[0]
            row = self.handoff.take(step)
            if row is None and not final and now - since < self.max_delay_s:
                return  # keep the order: later calls wait behind this one
            self._pending.popleft()
            if row is None:
                self.rows_missing += 1
            else:
                data = {**row, **data}  # the trainer's own keys win on a clash
            self.logger.log(data=data, step=step)
            self.handoff.discard_through(step)


def _has_sink(monitor: Any, sink: Any) -> bool:
    return any(s is sink for s in getattr(monitor, "sinks", ()))

