"""The sink protocol: where finished rows go.

A sink receives :class:`~gpulens.model.Row` objects, one per :meth:`gpulens.Monitor.log` call,
in step order. Sinks run in the monitor's writer thread, except those whose
``on_training_thread`` attribute is true (the Lightning, Accelerate and verl adapters, whose
framework loggers are not made for a second thread): those are fed from the training thread the
next time it calls ``log()`` or ``stop()``.

Optional parts of a sink:

* ``remote_spec() -> ("module:Class", kwargs)``: how to rebuild it in gpulens's engine process
  (``Monitor(isolation="process")``), which then writes it there and keeps its work off the
  training process (JSONL, MLflow, the dashboard).  Sinks without it are written in the
  training process, from rows the engine sends back.
* ``check()``: called by ``Monitor.start()`` before any sink opens or any run is made; raises
  a one-line ``ValueError`` saying how to fix a set-up that cannot work (W&B without a login,
  an MLflow server that does not answer).
* ``page_url``: the address of a page the sink serves (the dashboard), printed on stderr by
  ``Monitor.start()`` once it is served.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gpulens.model import Row, RunContext


@runtime_checkable
class Sink(Protocol):
    """Anything with ``open``, ``write`` and ``close`` can receive rows."""

    def open(self, context: RunContext) -> None:
        """Prepare to receive rows; raise ``ValueError`` for a user error (bad path, no run)."""

    def write(self, row: Row) -> None:
        """Write one row. May raise; the monitor counts, retries and reports failures."""

    def close(self) -> None:
        """Flush and release resources. Called once, also after failures."""
