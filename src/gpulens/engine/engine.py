"""The engine: built from an :class:`~gpulens.engine.spec.EngineSpec`, it opens the GPUs,
samples them, turns the client's step marks into rows, and writes the sinks it owns.

::

    engine = Engine(spec, on_row=...)     # nothing starts yet
    context, torch_indices = engine.start()
    engine.mark(Mark(...))                # each log() of the client
    engine.latest()                       # newest sample of each metric
    engine.stop(timeout)                  # last rows, sinks flushed: {sink name: SinkStats}

Each window becomes a row in the sampler thread; the engine *finishes* it there: the work the
client reported (tokens, FLOPs, CPU time) becomes throughput, TFLOP/s and MFU
(:mod:`gpulens.work.mfu`, against the GPU's peak in the run's dtype), the advice rules read it
(:mod:`gpulens.engine.rules`: ``alerts/<rule>`` keys, alert events, a WARNING when one fires),
and the finished row goes to the engine's sinks and, for the client's sinks, back
(``on_row(row, final=True)``).  In a distributed job the engine does its rank's part of the
gather itself (:mod:`gpulens.distributed.rows`, ``spec.gather_plan``): its raw rows go into
the node's shared file; a node's leader reduces them and, in a job of several nodes, sends
the node's summary to rank 0's engine through the job's store; rank 0's engine merges them
into the job's rows and finishes them in a thread of its own.  Where the job's store is not
one an engine can reach (not a ``TCPStore``), the raw row of each window goes back instead
(``final=False``) to meet the other ranks' in the client; rank 0's client hands the merged
row to :meth:`Engine.finish`.

The same engine runs in a process of gpulens's own (:mod:`gpulens.transport.process`) or in a
thread of the training process (:mod:`gpulens.transport.inproc`).  It never imports the
client; it tells what happens through the ``gpulens`` logger (forwarded to the training
process when it runs apart).
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from gpulens.engine.finish import Finisher
from gpulens.engine.sampler import MAX_MARKS, GpuState, Sampler
from gpulens.engine.spec import EngineSpec
from gpulens.errors import NvmlUnavailable
from gpulens.log import Laps, logger, warn_once
from gpulens.model import Event, GpuInfo, JobShape, Mark, Outcome, Row, RunContext, SinkStats
from gpulens.sinks.writer import STALL_S, StepLogger
from gpulens.sources.host import HostReader
from gpulens.sources.nvml import NvmlDevice, NvmlSource, VisibleGpu
from gpulens.sources.processes import GpuProcess

if TYPE_CHECKING:
    from gpulens.distributed.rows import RowGather

ENERGY_PROBE_S = 0.35
"""How long the engine reads each GPU's energy counter back to back, once sampling has begun,
to learn how often it changes (all GPUs at once, in threads; until then 0.1 s, an H200's)."""
LAST_ROWS_AFTER_A_FAULT_S = 2.0
"""At a stop that is no collective (this rank raised), how long rank 0 or a node's leader
still waits for the other ranks' rows of the steps it logged: those ranks are alive and their
engines send those rows within a window or two, while their training may soon hang in a
collective (it does not hold their engines up)."""


RowBack = Callable[[Row, bool], None]
"""Where rows go back to the client: ``(row, final)``; ``final`` False for a distributed
job's raw rows (for the rank gather), True for finished rows (for the client's sinks)."""


class Engine:
    """Sources -> sampler -> windows -> finishing (work, rules) -> step logger -> sinks (see
    the module doc)."""

    def __init__(self, spec: EngineSpec, on_row: RowBack | None = None) -> None:
        self.spec = spec
        self._on_row = on_row
        self._source: NvmlSource | None = None
        self._sampler: Sampler | None = None
        self._steplogger: StepLogger | None = None
        self._finisher: Finisher | None = None
        self._merged: queue.SimpleQueue[Row | None] = queue.SimpleQueue()
        self._merged_thread: threading.Thread | None = None
        self._gather: RowGather | None = None
        self._probe: threading.Thread | None = None
        self._notes: list[Event] = []
        self._notes_lock = threading.Lock()
        self.context: RunContext | None = None
        self.torch_indices: list[int] = []

    # -- start -------------------------------------------------------------------------------
    def start(self, late_job: Callable[[], JobShape | None] | None = None
              ) -> tuple[RunContext, list[int]]:
        """Open NVML and the sinks, start sampling (the sampler thread takes the first
        reading, all but its GPM sample, after this returns: :meth:`Sampler.start`).

        ``late_job``: gives the job's shape (``spec.job``), called once NVML and the GPUs are
        open, before anything that uses it (the client waits for the other ranks while this
        engine opens them).

        Returns the run's context and the torch device numbers whose allocator the client
        should read.  ``ValueError`` for what the user can fix (no such GPU, NVML asked for but
        absent, a sink that cannot open); everything opened is closed again first.
        """
        spec = self.spec
        laps = Laps("engine start")
        source = self._open_source()
        laps.mark("nvml")
        states: list[GpuState] = []
        steplogger: StepLogger | None = None
        try:
            if source is not None:
                for key, visible, torch_index in self._choose_gpus(source):
                    device = source.device(visible.nvml_index)
                    states.append(GpuState(key=key, device=device,
                                           info=device.info(key, visible.mig),
                                           torch_index=torch_index))
            infos = tuple(s.info for s in states)
            laps.mark("gpus")
            if late_job is not None:
                spec = self.spec = replace(spec, job=late_job())
                laps.mark("job shape waited")
            finisher = Finisher(spec, infos)
            context = RunContext(
                gpus=infos,
                hostname=socket.gethostname(),
                backend=source.name if source is not None else "none",
                interval=spec.interval,
                meta=finisher.meta,
                job=(spec.job.with_gpus(spec.rank[0], infos)
                     if spec.job is not None and spec.rank is not None else spec.job),
            )
            if context.job is not None:
                _say_shared_gpus(context.job)
            # built by their writer threads: their modules are imported off the way to "ready"
            steplogger = StepLogger(list(spec.sinks), names=[s.name for s in spec.sinks],
                                    buffer_rows=spec.buffer_rows)
            steplogger.open(context)
            laps.mark("context and sinks")
        except BaseException:
            for state in states:
                state.device.close()
            if source is not None:
                source.close()
            raise
        self._source, self._steplogger, self.context = source, steplogger, context
        self._finisher = finisher
        if spec.distributed:
            self._merged_thread = threading.Thread(target=self._finish_merged,
                                                   name="gpulens-finish", daemon=True)
            self._merged_thread.start()
        if spec.gather_plan is not None:
            self._gather = self._join_gather(spec, infos, context)
            laps.mark("gather")
        self._sampler = Sampler(
            states,
            interval=spec.interval,
            slow_interval=max(1.0, spec.interval),
            emit=self._emit,
            host=HostReader(),
            gpm=spec.gpm,
            energy=spec.energy,
            driver_samples=spec.driver_samples,
        )
        self._sampler.start(spec.step)
        laps.mark("sampler started")
        if spec.energy and states:
            self._probe = threading.Thread(target=self._probe_energy, args=(states,),
                                           name="gpulens-probe", daemon=True)
            self._probe.start()
        self.torch_indices = [s.torch_index for s in states if s.torch_index is not None]
        logger.info("gpulens: engine sampling %d GPU(s) via %s (%s)", len(states),
                    context.backend,
                    ", ".join(f"GPU {s.key}: {s.info.name}" for s in states) or "no GPU")
        laps.say()
        return context, self.torch_indices

    def _open_source(self) -> NvmlSource | None:
        backend = self.spec.backend
        source = NvmlSource(None if isinstance(backend, str) else backend)
        try:
            source.open()
        except NvmlUnavailable as exc:
            if backend == "nvml":
                raise ValueError(f"backend='nvml' was asked for, but {exc}") from exc
            if self.spec.gpus:
                raise ValueError(f"GPU {self.spec.gpus[0]} does not exist: no NVIDIA driver "
                                 f"answered ({exc})") from None
            if self.spec.require_gpu:
                raise ValueError(f"no GPU to monitor: no NVIDIA driver answered ({exc}); "
                                 "GPULENS_BACKEND=simulated gives simulated GPUs") from None
            warn_once("no-nvml", "gpulens: %s; logging host and training metrics only, no GPU "
                      "metrics (set GPULENS_BACKEND=simulated for simulated GPUs)", exc)
            return None
        return source

    def _choose_gpus(self, source: NvmlSource) -> list[tuple[int, VisibleGpu, int | None]]:
        """(row key, visible GPU, torch index) for each GPU to watch."""
        visible = source.visible_gpus()
        rank = self.spec.rank
        gpus = self.spec.gpus
        if not visible:
            cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
            if gpus:
                raise ValueError(f"GPU {gpus[0]} does not exist: this process sees no GPU "
                                 f"(CUDA_VISIBLE_DEVICES={cvd!r})")
            if self.spec.require_gpu:
                raise ValueError(f"no GPU to monitor: NVML works but this process sees no GPU "
                                 f"(CUDA_VISIBLE_DEVICES={cvd!r})")
            warn_once("no-visible-gpu", "gpulens: NVML works but this process sees no GPU "
                      "(CUDA_VISIBLE_DEVICES=%r); no GPU metrics", cvd)
            return []
        if gpus is None:
            if rank is not None:
                global_rank, local_rank, _ = rank
                ordinal = local_rank % len(visible)
                return [(global_rank, visible[ordinal], ordinal)]
            return [(i, v, i) for i, v in enumerate(visible)]
        out: list[tuple[int, VisibleGpu, int | None]] = []
        for g in gpus:
            if g >= len(visible):
                raise ValueError(
                    f"GPU {g} does not exist: this process sees {len(visible)} GPU(s)"
                    + (f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
                       if "CUDA_VISIBLE_DEVICES" in os.environ else "")
                )
            key = rank[0] if rank is not None and len(gpus) == 1 else g
            out.append((key, visible[g], g))
        return out

    def _join_gather(self, spec: EngineSpec, infos: tuple[GpuInfo, ...], context: RunContext
                     ) -> RowGather | None:
        """This rank's part of the job's gather (``spec.gather_plan``); ``None`` (said) where
        it cannot open the node's file: its rows are then not gathered."""
        plan = spec.gather_plan
        assert plan is not None
        try:
            return plan.gather(self.finish, gpu=infos[0].index if infos else plan.m.rank,
                               shape=context.job)
        except Exception as exc:
            logger.warning("gpulens: rank %d's engine could not join its node's gather (%r); "
                           "its rows are not gathered", plan.m.rank, exc)
            return None

    # -- running -----------------------------------------------------------------------------
    def _emit(self, row: Row) -> None:
        """A window's row (sampler thread): finished and written, or, in a distributed job,
        to meet the other ranks' (in this engine's gather, or back to the client raw)."""
        sampler = self._sampler
        if sampler is not None and sampler.notes:  # a GPU lost: told in the record too
            with self._notes_lock:
                while sampler.notes:
                    self._notes.append(sampler.notes.popleft())
        gather = self._gather
        if gather is not None:
            gather.local_row(row)
            return
        if self.spec.gather_plan is not None:
            return  # this rank's gather could not start (said)
        if self.spec.gather:
            if self._on_row is not None:
                self._on_row(row, False)
            return
        self._write(row)

    def _probe_energy(self, states: list[GpuState]) -> None:
        """Learn how often each GPU's energy counter changes (read back to back, all GPUs at
        once, while sampling goes on) and tell it in the next row (a notice event)."""
        sampler = self._sampler
        if sampler is not None:  # not beside the sampler's first reading, the slowest of all
            sampler.first_read.wait(2.0)  # within stop()'s wait for this thread
        found = _probe_energy_updates([s.device for s in states])
        notes: list[Event] = []
        for state in states:
            update = found.get(id(state.device))
            if update is None:
                continue
            state.energy_update_s = update
            if state.energy is not None:
                state.energy.update_s = update
            notes.append(Event(
                kind="notice", name="energy_counter", state="info", step=-1, time=time.time(),
                severity="info",
                message=f"GPU {state.key}'s energy counter changes every "
                        f"{update * 1000:.0f} ms; its reads are placed half that earlier",
                data={f"gpu/{state.key}/energy_update_s": update}))
        with self._notes_lock:
            self._notes.extend(notes)

    def _write(self, row: Row) -> None:
        finisher, steplogger = self._finisher, self._steplogger
        if self._notes:
            with self._notes_lock:
                notes, self._notes = self._notes, []
            row = replace(row, events=row.events + tuple(
                replace(n, step=row.step) for n in notes))
        if finisher is not None:
            row = finisher.finish(row)
        if steplogger is not None:
            steplogger.submit(row)
        if self.spec.rows_back and self._on_row is not None:
            self._on_row(row, True)

    def finish(self, row: Row) -> None:
        """A merged row of a distributed job (rank 0): finished and written in the engine's
        finishing thread, in order."""
        self._merged.put(row)

    def _finish_merged(self) -> None:
        while True:
            row = self._merged.get()
            if row is None:
                return
            try:
                self._write(row)
            except Exception as exc:  # this thread must outlive any one row
                warn_once("finish", "gpulens: could not finish a merged row: %r", exc)

    def drain(self) -> None:
        """Close the last windows (their rows go out as usual) and stop sampling; the sinks
        stay open for merged rows still to come (:meth:`finish`)."""
        sampler, self._sampler = self._sampler, None
        if sampler is None:
            return
        if self._probe is not None:  # it reads the devices about to close
            self._probe.join(ENERGY_PROBE_S + 5.0)
        sampler.stop(timeout=11.0)
        for state in sampler.gpus:
            state.device.close()
        self._drained_marks = sampler.dropped_marks
        if sampler.dropped_marks:
            logger.warning("gpulens: %d step mark(s) were dropped (more than %d waited for "
                           "their rows); their steps have no rows of their own",
                           sampler.dropped_marks, MAX_MARKS)

    _drained_marks = 0

    def mark(self, mark: Mark) -> None:
        """A step mark from the client: the window up to it becomes a row."""
        sampler = self._sampler
        if sampler is not None:
            sampler.add_mark(mark)

    def latest(self) -> dict[str, float]:
        """The newest sample of each metric, keyed like rows."""
        sampler = self._sampler
        return sampler.latest() if sampler is not None else {}

    def processes(self) -> list[GpuProcess]:
        """The processes on the watched GPUs (see :meth:`Sampler.processes`)."""
        sampler = self._sampler
        return sampler.processes() if sampler is not None else []

    def stats(self) -> dict[str, SinkStats]:
        """Figures of the engine's sinks so far."""
        steplogger = self._steplogger
        return steplogger.stats() if steplogger is not None else {}

    @property
    def dropped_marks(self) -> int:
        sampler = self._sampler
        return sampler.dropped_marks if sampler is not None else self._drained_marks

    def stop(self, timeout: float, stall: float = STALL_S, collective: bool = True,
             outcome: Outcome = "finished") -> dict[str, SinkStats]:
        """Close the last windows, meet the other ranks' last rows where this engine gathers
        (bounded, :meth:`RowGather.flush`: the time it takes comes out of ``timeout``, down to
        a floor of a second; not ``collective``: at most :data:`LAST_ROWS_AFTER_A_FAULT_S`),
        finish what is merged, write what the sinks hold and close them as ``outcome`` says
        (see :meth:`StepLogger.close`), release NVML.  Idempotent."""
        self.drain()
        gather, self._gather = self._gather, None
        if gather is not None:
            began = time.monotonic()
            # this rank raised: its logged steps' rows still meet the others' (in flight from
            # their engines), briefly; the written-without-them rows blamed the healthy ranks
            gather.flush(timeout if collective else min(timeout, LAST_ROWS_AFTER_A_FAULT_S))
            timeout = max(min(timeout, 1.0), timeout - (time.monotonic() - began))
        thread, self._merged_thread = self._merged_thread, None
        if thread is not None:
            self._merged.put(None)
            thread.join(timeout)
        stats: dict[str, SinkStats] = {}
        steplogger, self._steplogger = self._steplogger, None
        if steplogger is not None:
            stats = steplogger.close(timeout, stall, outcome)
        source, self._source = self._source, None
        if source is not None:
            source.close()
        return stats


def _probe_energy_updates(devices: list[NvmlDevice]) -> dict[int, float]:
    """The energy counter's update period of each device (by ``id``), probed in parallel."""
    out: dict[int, float] = {}

    def probe(device: NvmlDevice) -> None:
        try:
            value = device.probe_energy_update(ENERGY_PROBE_S)
        except Exception as exc:  # a lost GPU shows up at the first sample anyway
            logger.info("gpulens: energy counter probe failed: %r", exc)
            return
        if value is not None:
            out[id(device)] = value

    threads = [threading.Thread(target=probe, args=(d,), name="gpulens-probe", daemon=True)
               for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join(ENERGY_PROBE_S + 5.0)
    return out


def _say_shared_gpus(job: JobShape) -> None:
    """One WARNING for each group of ranks that watch one GPU (:meth:`JobShape.shared_gpus`)."""
    for ranks in job.shared_gpus():
        logger.warning("gpulens: ranks %s watch one GPU (on one node): its figures show under "
                       "each of them, and the job's sums (power, energy) and job/gpus count it "
                       "%d times (more ranks than GPUs, or gpus= naming one device on every "
                       "rank: leave gpus=None for each rank's LOCAL_RANK GPU)",
                       ", ".join(map(str, ranks)), len(ranks))
