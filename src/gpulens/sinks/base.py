"""The sink protocol: where finished rows go.

A sink receives :class:`Row` objects, one per :meth:`gpulens.Monitor.log` call, in step order.
Sinks run in the monitor's writer thread, except those whose ``on_training_thread`` attribute is
true (the Lightning, Accelerate and verl adapters, whose framework loggers are not made for a
second thread): those are fed from the training thread the next time it calls ``log()`` or
``stop()``.

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

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class GpuInfo:
    """Static facts about one monitored GPU."""

    index: int
    """The GPU's key in rows (``gpu/{index}/...``): global rank in distributed jobs."""
    name: str
    uuid: str
    pci_bus_id: str
    mem_total_gb: float | None = None
    power_limit_w: float | None = None
    mig: str | None = None
    """The MIG instance this process uses on this GPU (``"MIG 3g.40gb (MIG-...)"``), if any:
    the metrics are the whole GPU's, which NVML alone gives."""
    max_sm_clock_mhz: float | None = None
    """The SM clock's maximum (boost), MHz: the clock the datasheet peak assumes."""
    default_power_limit_w: float | None = None
    """The board's default power limit, W (tells variants of one name apart, e.g. H200 SXM
    from NVL, whatever limit an operator set)."""


@dataclass(frozen=True)
class RunContext:
    """What a sink may want to know when it opens."""

    gpus: tuple[GpuInfo, ...]
    hostname: str
    backend: str
    """``"nvml"``, ``"simulated"`` or ``"none"`` (no driver: host and training metrics only)."""
    interval: float
    """Seconds between cheap samples."""
    meta: dict[str, str | float] = field(default_factory=dict)
    """What else a record of the run should say: the compute dtype, each GPU's peak and its
    source (``peak_tflops``, ``peak_source``), how model FLOPs were counted ... (sinks that
    keep run metadata write it: the JSONL header, MLflow params, W&B config)."""


@dataclass(frozen=True)
class Event:
    """Something the engine tells about a step, beside its figures: an alert of an advice rule
    firing or clearing, or a notice (a GPU lost, a gap).

    Sinks that can show events do (JSONL ``event`` lines, W&B alerts, MLflow tags, the report,
    the dashboard); the others ignore them.
    """

    kind: str
    """``"alert"`` (a rule's state changed) or ``"notice"``."""
    name: str
    """The rule or cause, e.g. ``"input_bound"``; alerts also set ``alerts/<name>`` in the row."""
    state: str
    """``"firing"`` or ``"resolved"`` for alerts; ``"info"`` for notices."""
    step: int
    """The training step at which it happened."""
    time: float
    """Unix time in seconds."""
    severity: str = "warning"
    """``"info"``, ``"warning"`` or ``"critical"``."""
    message: str = ""
    """What was seen, with numbers."""
    advice: str = ""
    """What to try."""
    data: dict[str, float] = field(default_factory=dict)
    """The figures behind the message (e.g. ``{"perf/data_wait_pct": 41.0}``)."""


@dataclass(frozen=True)
class Row:
    """One step-aligned record.

    ``values`` uses the keys of :mod:`gpulens.schema`; ``train/global_step`` is always present.
    ``events`` holds what the engine tells about this step (alerts, notices), usually nothing.
    """

    step: int
    time: float
    """Unix time in seconds at the end of the window (when ``log()`` was called)."""
    values: dict[str, float] = field(default_factory=dict)
    events: tuple[Event, ...] = ()


@runtime_checkable
class Sink(Protocol):
    """Anything with ``open``, ``write`` and ``close`` can receive rows."""

    def open(self, context: RunContext) -> None:
        """Prepare to receive rows; raise ``ValueError`` for a user error (bad path, no run)."""

    def write(self, row: Row) -> None:
        """Write one row. May raise; the monitor counts, retries and reports failures."""

    def close(self) -> None:
        """Flush and release resources. Called once, also after failures."""
