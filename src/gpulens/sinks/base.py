"""The sink protocol: where finished rows go.

A sink receives :class:`Row` objects, one per :meth:`gpulens.Monitor.log` call, in step order.
Each sink is opened and written by a worker thread of its own (a tracker's ``open`` may take
seconds: it never holds up ``Monitor.start()``), except those whose ``on_training_thread``
attribute is true (the Lightning, Accelerate and verl adapters, whose framework loggers are not
made for a second thread): those are opened by ``start()`` and fed from the training thread the
next time it calls ``log()`` or ``stop()``.  A sink object given to a monitor runs in the
training process; a sink chosen by name runs where :mod:`gpulens.sinks` says (the engine for
JSONL, MLflow, Prometheus and the dashboard).

Optional parts of a sink object, called by ``Monitor.start()`` on the thread that starts it,
before anything is opened or made:

* ``prepare()``: read what only that thread knows (MLflow's active run is per thread), then
  check as ``check()`` does;
* ``check()`` (when there is no ``prepare``): raise a one-line ``ValueError`` saying how to fix
  a set-up that cannot work (W&B without a login, an MLflow server that refuses connections).
  Both must be cheap (no tracker import, no request): ``start()`` returns in a fraction of a
  second.  What they cannot tell, ``open`` finds: a WARNING then, and the sink's rows are
  counted as dropped.

A sink that ends a run of its own at ``close`` (MLflow's and W&B's, where no run was active at
start) also has ``end_run_as(outcome)`` (:class:`EndsRun`): the monitor calls it just before
``close`` with how training ended, so a run whose training raised is not marked a success.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gpulens.model import Outcome, Row, RunContext


@runtime_checkable
class Sink(Protocol):
    """Anything with ``open``, ``write`` and ``close`` can receive rows."""

    def open(self, context: RunContext) -> None:
        """Prepare to receive rows; raise ``ValueError`` for a user error (bad path, no run)."""

    def write(self, row: Row) -> None:
        """Write one row. May raise; the monitor counts, retries and reports failures."""

    def close(self) -> None:
        """Flush and release resources. Called once, also after failures."""


@runtime_checkable
class EndsRun(Protocol):
    """A sink that ends a tracker run of its own at ``close``."""

    def end_run_as(self, outcome: Outcome) -> None:
        """Training ended so (:data:`~gpulens.model.Outcome`): ``close``, called next, ends
        the sink's own run with the matching status; a run it did not start is left alone."""
