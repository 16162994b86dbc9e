"""The data every layer passes: a GPU's identity, the run's context, a row, an event, a step mark.

These types sit at the ground of the package: sources, the engine, the transport, sinks,
integrations and the command line all import them from here, and this module imports nothing
of gpulens (the keys of :attr:`Row.values` are those of :mod:`gpulens.schema`).

* :class:`GpuInfo`: static facts about one monitored GPU.
* :class:`RunContext`: what a sink may want to know when it opens; in a distributed job its
  :class:`JobShape` (every rank's :class:`RankInfo`: node, local rank, GPU).
* :class:`Row`: one step-aligned record, with the :class:`Event` objects of its step.
* :class:`Mark` / :data:`MarkFields`: a ``log()`` call as it crosses from the client (the
  training process) to the engine.
* :class:`SinkSpec`: a sink chosen by name, as it crosses to where it is built (the registry
  of names is :mod:`gpulens.sinks`); :class:`SinkStats`: what happened to one sink's rows.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

ENGINE = "engine"
"""A sink built and written in the engine (its own process, or its thread)."""
CLIENT = "client"
"""A sink built and written in the training process."""

Outcome = Literal["finished", "failed", "killed"]
"""How training ended, as a monitor's stop tells its sinks: ``"failed"`` (it raised),
``"killed"`` (interrupted: Ctrl-C, or its process vanished without stopping the monitor), else
``"finished"``.  A sink that ends a run of its own ends it so (MLflow's run status, W&B's exit
code)."""


def outcome_of(exc: BaseException | None) -> Outcome:
    """The :data:`Outcome` of training that ended with ``exc`` (``None``: no exception).  A
    ``SystemExit`` is the process's exit status: ``sys.exit()`` or ``sys.exit(0)`` ends it
    ``"finished"`` (as W&B's exit hook, the shell and a scheduler see it), any other code
    ``"failed"``."""
    if exc is None:
        return "finished"
    if isinstance(exc, SystemExit):
        return "finished" if exc.code is None or exc.code == 0 else "failed"
    return "killed" if isinstance(exc, KeyboardInterrupt) else "failed"


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
    job: JobShape | None = None
    """A distributed job's shape (every rank's node and GPU: rank 0's view; a node leader's:
    its node's), or ``None`` for a job of one process."""


@dataclass(frozen=True)
class RankInfo:
    """One rank of a distributed job: where it runs and the GPU it trains on."""

    rank: int
    local_rank: int
    node: int
    """The node's index in the job."""
    node_name: str
    gpus: tuple[GpuInfo, ...] = ()
    """The GPU(s) this rank samples (one per rank in DDP-like jobs); their ``index`` is the
    key of their figures in rows (``gpu/{index}/...``: the global rank)."""


@dataclass(frozen=True)
class JobShape:
    """Every rank of a distributed job, as far as the start exchange found them
    (:mod:`gpulens.distributed.start`)."""

    world: int
    """Ranks in the job."""
    nodes: int
    """Nodes in the job."""
    launcher: str
    ranks: tuple[RankInfo, ...] = ()
    """By global rank; a rank that did not answer the start exchange is absent."""
    view: str = "job"
    """``"job"``: rank 0's view (every node); ``"node"``: a node leader's (its node only)."""
    missing: tuple[int, ...] = ()
    """Ranks that did not answer the start exchange in time."""

    def node_names(self) -> dict[int, str]:
        """Node index -> node name."""
        return {r.node: r.node_name for r in self.ranks}

    def with_gpus(self, rank: int, gpus: tuple[GpuInfo, ...]) -> JobShape:
        """A copy with ``rank``'s GPUs filled in (the engine knows its own)."""
        ranks = tuple(RankInfo(r.rank, r.local_rank, r.node, r.node_name, gpus)
                      if r.rank == rank and not r.gpus else r for r in self.ranks)
        return JobShape(self.world, self.nodes, self.launcher, ranks, self.view, self.missing)

    def shared_gpus(self) -> list[tuple[int, ...]]:
        """Rank 0's job view: groups of ranks of one node that watch one GPU (its UUID). Each
        rank's figures are keyed by its global rank, so such a GPU (``gpus=[0]`` on every
        rank, more ranks than GPUs) shows under each, and the job's sums
        (``gpu/all/power_w_sum``, energy per step) and ``job/gpus`` count it once a rank."""
        if self.view != "job":
            return []
        by_gpu: dict[tuple[int, str], set[int]] = {}
        for info in self.ranks:
            for gpu in info.gpus:
                if gpu.uuid:
                    by_gpu.setdefault((info.node, gpu.uuid), set()).add(info.rank)
        return [tuple(sorted(ranks)) for ranks in by_gpu.values() if len(ranks) > 1]


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


class Mark(NamedTuple):
    """A ``log()`` call: the end of one window (it crosses from the client to the engine)."""

    step: int
    t: float
    """``time.monotonic()`` at the call."""
    wall: float
    """``time.time()`` at the call."""
    scalars: dict[str, float]
    """As passed to ``log()``, as numbers (the client converts tensors off the training
    thread); named ``train/<name>`` here."""
    alloc: dict[int, tuple[float, float, float, float]] | None = None
    """Torch allocator figures per torch device, read by the client at the call: (allocated
    GB, peak GB, allocation retries, OOMs); ``None`` when not read."""


MarkFields = tuple[int, float, float, dict[str, Any], dict[int, tuple[float, float, float, float]]
                   | None]
"""A :class:`Mark`'s fields as the plain tuple ``log()`` makes and the pipe carries: making the
named tuple costs the training thread ~0.7 us a call (its ``__new__`` is Python), so it is made
only where the mark arrives (``Mark(*fields)``)."""


@dataclass
class SinkStats:
    """What happened to the rows of one sink."""

    written: int = 0
    dropped: int = 0
    """Rows dropped: the buffer was full, the sink still failed at stop, or the process that
    wrote it died with rows unwritten."""
    failures: int = 0
    """Failed write attempts (each retried)."""


def _load(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


@dataclass(frozen=True)
class SinkSpec:
    """A sink chosen by name: what to build (``target`` called with ``options``), where, and
    the name it goes by.  Pickles; built by :meth:`build` where it runs.  Made by
    :func:`gpulens.sinks.parse_sink` and :func:`gpulens.sinks.sink_spec`, which take
    ``target`` and ``where`` from the registry (:data:`gpulens.sinks.SINKS`) and check the
    options there."""

    name: str
    """As the user wrote it (``"jsonl:/dev/full"``): its name in messages and stats."""
    kind: str
    """Its key in :data:`gpulens.sinks.SINKS`, or ``""`` for a spec made in code around
    another (a wrapper)."""
    options: dict[str, Any] = field(default_factory=dict)
    """The constructor's keyword arguments (a nested :class:`SinkSpec` is prepared and checked
    with this one, and built by the class it is given to)."""
    target: str = ""
    """``"module:Class"`` of the sink."""
    where: str = ""
    """:data:`ENGINE` or :data:`CLIENT`."""

    def __post_init__(self) -> None:
        if not self.target or self.where not in (ENGINE, CLIENT):
            raise ValueError(f"sink spec {self.name!r}: needs a target and where "
                             f"({ENGINE!r} or {CLIENT!r})")

    def build(self) -> Any:
        """The sink object (a :class:`gpulens.sinks.base.Sink`; imports its module, and
        nothing heavy: the sink imports its tracker library when it opens)."""
        return _load(self.target)(**self.options)

    def prepared(self) -> SinkSpec:
        """This spec as it starts, in the process that starts the monitor: options only that
        process knows resolved, cheap checks made (``ValueError``, one line).  Idempotent."""
        options = {k: v.prepared() if isinstance(v, SinkSpec) else v
                   for k, v in self.options.items()}
        prepare = getattr(_load(self.target), "prepare_options", None) if self.kind else None
        if prepare is not None:
            options = prepare(options)
        return replace(self, options=options)
