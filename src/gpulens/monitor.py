"""``Monitor``: the client the training loop holds.  Thin: it stamps step marks, reads the
torch allocator, writes the sinks given as objects, and joins the rank gather's start; the
engine (:mod:`gpulens.engine`) does the rest, in a process of its own or, as a fallback, a thread.

::

    import gpulens
    with gpulens.Monitor(interval=0.5, sinks=["wandb", "jsonl:runs/gpu.jsonl"]) as mon:
        for step, batch in enumerate(loader, start=1):
            loss, lr, gn = train_step(batch)
            mon.log(step, loss=loss, learning_rate=lr, grad_norm=gn)

Each ``log`` call ends a window and writes one row (see :mod:`gpulens.schema` for its keys).
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from gpulens.engine.spec import WORK_CPU, WORK_FLOPS, WORK_SAMPLES, WORK_TOKENS, EngineSpec
from gpulens.finalizers import drop_exit_finalizer, exit_finalizer, exit_outcome
from gpulens.log import Laps, effective_level, logger, warn_once
from gpulens.model import Outcome, Row, RunContext, SinkStats, outcome_of
from gpulens.settings import (
    Settings,
    backend_for,
    distributed_env,
    isolation_for,
    normalize_run_dtype,
)
from gpulens.sinks import ENGINE, SinkSpec, as_sink, prepare_sinks, unique_names
from gpulens.sinks.base import Sink
from gpulens.sinks.wandb_run import stop_before_finish, tell_wandb_run_missed, wandb_starts_own_run
from gpulens.sinks.writer import STALL_S, STOP_TIMEOUT_S, StepLogger
from gpulens.sources.processes import GpuProcess
from gpulens.sources.torch_alloc import TorchAllocator
from gpulens.transport import spawn
from gpulens.transport.base import SpawnFailed, Transport
from gpulens.transport.inproc import InprocTransport
from gpulens.transport.process import ProcessTransport
from gpulens.transport.relay import MarkRelay


class _Link:
    """What the transport and the rank gather call back into while a monitor runs: this
    process's sink writer and the gather, never the :class:`Monitor` itself, so that a monitor
    nobody holds any more is garbage-collected, and its finalizer stops it."""

    def __init__(self) -> None:
        self.transport: Transport | None = None
        self.gather: Any = None
        self.writer: StepLogger | None = None

    def on_row(self, row: Row, final: bool) -> None:
        """A row from the engine (its thread; or, from an engine process, ``log()`` or the
        link thread): a rank's own row for the gather, or a finished row for this process's
        sinks."""
        if not final:  # the raw row of a job this process gathers (its store is no TCPStore)
            if self.gather is not None:
                self.gather.local_row(row)
        elif self.writer is not None:
            self.writer.submit(row)

    def finish_merged(self, row: Row) -> None:
        """Rank 0: a row that met every rank's goes to the engine to be finished (work,
        rules) and written."""
        transport = self.transport
        if transport is not None:
            transport.finish(row)


class Monitor:
    """Samples this process's GPUs and writes one row per :meth:`log` call to the sinks.

    Args:
        gpus: CUDA device numbers to watch, as this process numbers them (after
            ``CUDA_VISIBLE_DEVICES``).  ``None``: every GPU this process can see, or in a
            distributed job (``WORLD_SIZE`` > 1) only this rank's GPU (``LOCAL_RANK``).  A
            GPU named that does not exist (no driver, or fewer GPUs) is a ``ValueError`` at
            :meth:`start`.
        interval: seconds between cheap samples (utilization, memory, power, temperature,
            clocks); must be > 0.  Energy and the driver's buffered samples are read every
            ``max(1 s, interval)`` (the buffered samples also a fifth of a second after each
            ``log()``, so rows come soon); GPM, whose counters refresh about every 100 ms, is
            polled every ``max(50 ms, interval / 2)``.
        sinks: names (``"wandb"``, ``"mlflow"``, ``"jsonl:PATH"``, ``"prometheus:PORT"``,
            ``"dashboard:PORT"``), specs (:func:`gpulens.sinks.sink_spec`) or objects with
            ``open``/``write``/``close``.  A name is parsed now (a bad one is a ``ValueError``)
            and its sink built in the engine: JSONL, MLflow, Prometheus, the dashboard and
            W&B (attached to this process's ``wandb.run``, or to a run of its own when there
            is none).  Objects are written here.  ``start()`` checks what it can cheaply (a
            path, a server's port, a login) and opens the sinks off this thread: one that
            then fails to open is a WARNING, its rows counted as dropped.
        backend: ``"nvml"``, ``"simulated"``, ``"auto"``/``None`` (NVML if a driver answers),
            or an NVML-like object such as :class:`gpulens.testing.SimulatedNVML`.  The
            environment variable ``GPULENS_BACKEND`` (with ``GPULENS_SIMULATED_GPUS=N``; 0 is
            a machine where no driver answers) picks one when the argument is ``None``.
        buffer_rows: rows each sink may fall behind before the oldest are dropped (counted).
        gpm, energy, driver_samples: switch off a costly read (GPM activity; the energy
            counter, 3-15 ms a call on an H200; the driver's buffered power and utilization
            samples, ~2.4 ms).  Without them the figures come from the cheap reads alone:
            no ``sm_active_pct``/``tensor_active_pct``, energy integrated from power.
        distributed: gather the ranks' rows on rank 0 (``None``: when torch.distributed is
            initialised with more than one rank).  Then every rank must call :meth:`log` for
            the same steps: it is a collective.
        isolation: where the engine (sampler, windows, the sinks that can live there) runs.
            ``"process"``: a process of its own; this process only sends step marks down a
            pipe.  ``"thread"``: a thread of this process.  ``"auto"`` (default;
            ``GPULENS_ISOLATION`` overrides it): a process, unless ``backend`` is an object
            that does not pickle, or no process can be started (then a thread, with a
            warning).
        dtype: the run's compute dtype (``"bf16"``, ``torch.bfloat16``, a Lightning precision
            such as ``"bf16-mixed"``): picks the column of the GPU's peak for MFU, and lets the
            low-tensor-core rule judge.  Unknown: no MFU (said once), never a borrowed peak.
        flops_per_token, flops_per_sample: model FLOPs (forward + backward) per token or per
            sample (:func:`gpulens.work.hf.model_flops` computes them for a Hugging Face
            model).  With the work of each step (``log(step, tokens=...)``) they give
            ``perf/tflops`` and ``perf/mfu_pct``.
        require_gpu: no GPU to monitor (no driver, or none visible) is a ``ValueError`` at
            :meth:`start`, not a warning and host-only rows (``gpulens watch``).
        wall_clock: each :meth:`log` is a tick of a clock, not a training step (``gpulens
            record``, ``serve``): no ``perf/*`` or ``train/global_step`` in the rows, and
            only the advice rules about the hardware (power cap, heat) judge them.

    Rows are finished by the engine a little after ``log()`` (once the data covering the
    window has been read: usually a quarter of a second, at most about 10 s on a starved
    machine); ``stop()`` writes all of them.  Everything the engine says (warnings, drops,
    a lost GPU) reaches this process's ``gpulens`` logger at its level.

    The arguments are checked once, into a :class:`~gpulens.settings.Settings` value
    (:attr:`settings`; :meth:`from_settings` makes a monitor from one).  A monitor dropped
    without :meth:`stop` is stopped when it is garbage-collected (its rows written, its
    engine ended) or when the interpreter exits.
    """

    def __init__(
        self,
        gpus: Sequence[int] | None = None,
        interval: float = 0.5,
        sinks: Iterable[str | SinkSpec | Sink] = (),
        backend: Any = None,
        *,
        buffer_rows: int = 10_000,
        distributed: bool | None = None,
        gpm: bool = True,
        energy: bool = True,
        driver_samples: bool = True,
        isolation: str = "auto",
        dtype: Any = None,
        flops_per_token: float | None = None,
        flops_per_sample: float | None = None,
        require_gpu: bool = False,
        wall_clock: bool = False,
    ) -> None:
        if isinstance(sinks, (str, bytes, SinkSpec, Sink)):
            sinks = [sinks]
        self._setup(Settings(
            gpus=tuple(gpus) if gpus is not None else None, interval=interval,
            sinks=tuple(as_sink(s) for s in sinks), backend=backend, buffer_rows=buffer_rows,
            distributed=distributed, gpm=gpm, energy=energy, driver_samples=driver_samples,
            isolation=isolation, dtype=dtype, flops_per_token=flops_per_token,
            flops_per_sample=flops_per_sample, require_gpu=require_gpu, wall_clock=wall_clock))

    @classmethod
    def from_settings(cls, settings: Settings) -> Monitor:
        """A monitor (not started) with these settings."""
        monitor = cls.__new__(cls)
        monitor._setup(settings)
        return monitor

    def _setup(self, settings: Settings) -> None:
        if not isinstance(settings, Settings):
            raise ValueError(f"expected gpulens.settings.Settings, got {settings!r}")
        self._settings = settings
        self.isolation: str | None = None
        """``"process"`` or ``"thread"`` once started."""
        self.context: RunContext | None = None
        self.sink_stats: dict[str, SinkStats] = {}
        """Rows written and dropped per sink (named as given, or by class); filled by stop()."""
        self._transport: Transport | None = None
        self._relay: MarkRelay | None = None
        self._link: _Link | None = None
        self._gather: Any = None
        self._steplogger: StepLogger | None = None
        """The link's gather and writer, kept here too for ``log()``."""
        self._alloc = TorchAllocator()
        self._alloc_due = -math.inf
        self._torch_indices: list[int] = []
        self._slow = max(1.0, settings.interval)
        self._last_step: int | None = None
        self._cpu_at: tuple[int, float] | None = None
        """(thread, its CPU seconds) at the previous ``log()`` or ``start()``."""
        self._started = False
        self._stopped = False
        self._dropped_marks = 0
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._unhook: Any = None
        """Takes back :func:`stop_before_finish`'s hook on the user's W&B run."""
        self._wandb_alone = False
        """A "wandb" sink started with no W&B run here: the engine starts a run of its own."""

    @property
    def settings(self) -> Settings:
        """What this monitor samples and where it writes (a frozen value)."""
        return self._settings

    @property
    def interval(self) -> float:
        return self._settings.interval

    @property
    def gpus(self) -> list[int] | None:
        gpus = self._settings.gpus
        return list(gpus) if gpus is not None else None

    @property
    def sinks(self) -> tuple[SinkSpec | Sink, ...]:
        """The sinks as given: specs (names parsed) and objects."""
        return self._settings.sinks

    def with_sinks(self, sinks: Iterable[str | SinkSpec | Sink], *, dtype: Any = None
                   ) -> Monitor:
        """A new, unstarted monitor with this one's settings and other sinks (and the run's
        dtype, where this one has none): ``Monitor.from_settings(dataclasses.replace(...))``.

        Integrations check their arguments by building :class:`Settings` when they are
        constructed and make the monitor they start once they know the run's sinks (rank 0
        only, a framework's own W&B or MLflow run, ...) and its dtype.
        """
        settings = self._settings
        return Monitor.from_settings(replace(
            settings, sinks=tuple(as_sink(s) for s in sinks),
            dtype=settings.dtype if settings.dtype is not None else normalize_run_dtype(dtype)))

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        self.start()
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, *tb: object) -> None:
        # an exception: the other ranks may be stuck in training's collectives, so no gather
        self.stop(collective=exc is None, outcome=outcome_of(exc))

    @property
    def running(self) -> bool:
        return self._started

    def _choose_transport(self, backend: Any) -> Transport:
        isolation, why = isolation_for(self._settings, backend)
        if isolation == "process":
            return ProcessTransport()
        if why is not None:
            logger.info("gpulens: %s; sampling in a thread of this process", why)
        spawn.drop()  # a spare made for this start would idle until its retirement
        return InprocTransport()

    def start(self, step: int = 0) -> Monitor:
        """Check the sinks (a one-line ``ValueError`` for what can be known now: see the
        ``sinks`` argument) and start the engine (a process or a thread, see ``isolation``);
        its first sample and the sinks' opening happen off this thread, rows waiting for them
        (:meth:`latest` may be empty for a moment).
        Idempotent while running; a stopped monitor starts afresh.

        ``step``: the training step the first window starts after (0 for a fresh run; a
        resumed run passes the step it resumes from), so the first row's per-step figures
        divide by the right number of steps.
        """
        with self._lock:
            if self._started:
                return self
            settings = self._settings
            laps = Laps("start")
            backend = backend_for(settings)
            link = _Link()
            gather = link.gather = self._make_gather(link)  # rank rows may come once started
            if gather is not None:
                laps.mark("ranks met")
            try:
                # rank 0: every sink; above 8 ranks another node's leader its node's (JSONL,
                # Prometheus)
                sinks = settings.sinks if gather is None else gather.sinks_for(settings.sinks)
                named = _prepare(sinks)  # a one-line error before any sink opens or run is made
                self._wandb_alone = wandb_starts_own_run(named)
                transport = self._choose_transport(backend)
                try:
                    context, torch_indices = self._start_engine(transport, link, named, backend,
                                                                step)
                except SpawnFailed as exc:
                    warn_once("spawn", "gpulens: %s; sampling in a thread of this process "
                              "instead", exc)
                    transport = InprocTransport()
                    context, torch_indices = self._start_engine(transport, link, named,
                                                                backend, step)
                laps.mark("engine")
                if gather is not None:
                    gather.bind(context)
                    laps.mark("GPU said to the others")
                writer = link.writer
                assert writer is not None
                writer.open(context)
                laps.mark("this process's sinks")
            except BaseException:
                if link.transport is not None:
                    link.transport.stop(2.0, 2.0, collective=False)
                if gather is not None:
                    gather.close()
                raise
            relay = MarkRelay(link.transport.send_mark)  # type: ignore[union-attr]
            self._transport, self._relay, self._link = link.transport, relay, link
            self._gather, self._steplogger = gather, writer
            self.context, self._torch_indices = context, torch_indices
            self.isolation = link.transport.isolation  # type: ignore[union-attr]
            self._alloc_due = -math.inf
            self._cpu_at = (threading.get_ident(), time.thread_time())
            self._last_step = None
            self._dropped_marks = 0
            self._started, self._stopped = True, False
            # nothing these hold refers to this monitor: dropped, it is collected and stopped
            # exit hook after wandb.init's: at an exit without stop() W&B still takes rows
            self._finalizer = exit_finalizer(self, _stop_dropped, link, relay)
            self._unhook = stop_before_finish(named, self)  # a crash, then wandb.finish()
            logger.info("gpulens: monitoring %d GPU(s) via %s every %.3g s (engine in a %s)",
                        len(context.gpus), context.backend, settings.interval, self.isolation)
            laps.say()
            return self

    def _start_engine(self, transport: Transport, link: _Link,
                      named: list[tuple[str, SinkSpec | Sink]], backend: Any, step: int
                      ) -> tuple[RunContext, list[int]]:
        """Which sinks the engine builds and writes, which this process does; start it.

        Specs of sinks that run in the engine (all of the registry's: JSONL, MLflow, W&B,
        Prometheus, the dashboard) go to the engine, which builds them; a spec made for this
        process is built here, and objects are written here as they are, from the rows the
        engine hands back (only then does it hand rows back).
        """
        settings = self._settings
        engine_sinks: list[SinkSpec] = []
        local: list[Sink | SinkSpec] = []
        local_names: list[str] = []
        for name, sink in named:
            if isinstance(sink, SinkSpec) and sink.where == ENGINE:
                engine_sinks.append(replace(sink, name=name))
            else:
                local.append(sink)  # a spec is built by its writer thread
                local_names.append(name)
        spec = EngineSpec(
            interval=settings.interval, gpus=settings.gpus, backend=backend,
            buffer_rows=settings.buffer_rows, step=int(step), sinks=tuple(engine_sinks),
            rows_back=bool(local),
            gather=link.gather is not None and not link.gather.in_engine,
            gather_plan=link.gather.engine_plan() if link.gather is not None else None,
            rank=link.gather.placement if link.gather is not None else distributed_env(),
            log_level=effective_level(), dtype=settings.dtype,
            flops_per_token=settings.flops_per_token,
            flops_per_sample=settings.flops_per_sample, gpm=settings.gpm,
            energy=settings.energy, driver_samples=settings.driver_samples,
            require_gpu=settings.require_gpu, wall_clock=settings.wall_clock,
        )
        link.writer = StepLogger(local, names=local_names, buffer_rows=settings.buffer_rows)
        link.transport = transport
        try:
            return transport.start(spec, link.on_row, None if link.gather is None
                                   else link.gather.shape_before_engine)
        except BaseException:
            link.transport = None
            raise

    def _make_gather(self, link: _Link) -> Any:
        """The rank gather of a distributed job, or ``None``."""
        if self._settings.distributed is False:
            return None
        from gpulens.distributed import torch_distributed_ready

        if not torch_distributed_ready():
            if self._settings.distributed:
                raise ValueError("distributed=True, but torch.distributed is not initialised "
                                 "with more than one rank")
            return None
        from gpulens.distributed.gather import JobGather

        return JobGather(submit=link.finish_merged, gpus=self._settings.gpus)

    # -- the training thread -------------------------------------------------------------------
    def log(self, step: int, *, tokens: Any = None, samples: Any = None, flops: Any = None,
            **scalars: Any) -> None:
        """End the current window at training step ``step`` and write one row.

        ``scalars`` (loss, learning_rate, grad_norm, ...) go into the same row; a name without
        ``/`` is written as ``train/<name>``.  Pass Python numbers; a CUDA tensor's copy to
        the host starts here and is read at a later call once it has landed (never
        synchronised; its row is then finished a log period later), other tensors in the
        background; a value that is not a number is left out with a warning.  Never blocks on
        a network.  In a distributed job this is a collective: every rank must call it for the
        same steps.

        ``tokens``, ``samples``, ``flops``: the work this process did since its previous
        ``log`` (real tokens, padding left out; model FLOPs, forward and backward).  They give
        ``perf/tokens_per_s`` / ``perf/samples_per_s``, ``perf/tokens_per_j``, and with the
        model's FLOPs (``flops``, or ``flops_per_token`` given to the monitor)
        ``perf/tflops`` and ``perf/mfu_pct``; in a distributed job the ranks' work is summed.
        """
        self.log_at(None, step, tokens=tokens, samples=samples, flops=flops, **scalars)

    def log_at(self, at: tuple[float, float] | None, step: int, *, tokens: Any = None,
               samples: Any = None, flops: Any = None, **scalars: Any) -> None:
        """:meth:`log` of a step that ended at ``at`` (``time.monotonic(), time.time()``; None:
        now): a row written later, where it costs least (``TrainingSession.row``)."""
        if not self._started:
            if self._stopped:
                raise RuntimeError("Monitor.log() after stop(): this monitor is stopped "
                                   "(start() it again for a new run)")
            raise RuntimeError("Monitor.log() before start(); use `with Monitor(...)` or start()")
        step = int(step)
        if self._last_step is not None and step < self._last_step:
            warn_once("step-backwards", "gpulens: log() at step %d after step %d: steps went "
                      "backwards (a resume without start(step=...)?); rows keep the steps given",
                      step, self._last_step)
        self._last_step = step
        now, wall = at if at is not None else (time.monotonic(), time.time())
        alloc = None
        if now >= self._alloc_due and self._torch_indices:
            self._alloc_due = now + self._slow
            alloc = self._read_alloc()
        if self._gather is not None:
            # the training thread's CPU time since the previous log(), for the slow-rank rule:
            # this thread's alone, so that gpulens's own threads (the gather's merging on rank
            # 0, a sink's) never make a rank look slow; none where start() ran on another thread
            cpu = (threading.get_ident(), time.thread_time())
            if self._cpu_at is not None and self._cpu_at[0] == cpu[0]:
                scalars[WORK_CPU] = cpu[1] - self._cpu_at[1]
            self._cpu_at = cpu
        if tokens is not None:
            scalars[WORK_TOKENS] = tokens
        if samples is not None:
            scalars[WORK_SAMPLES] = samples
        if flops is not None:
            scalars[WORK_FLOPS] = flops
        relay = self._relay
        assert relay is not None
        # a Mark's fields, as they cross; in a distributed job the gather takes the row the
        # engine makes of it on another thread (log() itself never wakes the gather thread)
        relay.put((step, now, wall, scalars, alloc))
        transport = self._transport
        if transport is not None:
            transport.take_rows()  # rows back, for this process's sinks and the gather
        steplogger = self._steplogger
        if steplogger is not None:
            steplogger.drain_training_thread()

    def _read_alloc(self) -> dict[int, tuple[float, float, float, float]] | None:
        """The torch allocator's figures, read here for the engine (one host-side call per
        GPU, once a slow period)."""
        out: dict[int, tuple[float, float, float, float]] = {}
        for index in self._torch_indices:
            mem = self._alloc.read(index)
            if mem is not None:
                out[index] = mem
        return out or None

    # -- stop ------------------------------------------------------------------------------------
    def stop(self, timeout: float | None = None, *, collective: bool = True,
             outcome: Outcome = "finished") -> dict[str, SinkStats]:
        """Close the last windows, write what every sink holds, and stop.  Idempotent.

        In a distributed job every rank calls ``stop()`` (the ranks' last rows meet; nothing
        waits for a rank that does not come longer than the gather's bounded wait).
        ``collective=False`` (an error on the way out of one rank) skips this rank's last
        exchange: its last windows not yet gathered are not written (said).  ``outcome``:
        how training ended, ``"finished"``, ``"failed"`` (it raised) or ``"killed"``
        (interrupted); a tracker run that gpulens began itself (none was active at start) ends
        with that status (MLflow's ``FAILED``/``KILLED``, W&B's exit code 1), the user's own
        runs are left alone.  ``with Monitor(...)`` passes it.

        Waits while the sinks make progress: at most ``timeout`` seconds (default
        :data:`~gpulens.sinks.writer.STOP_TIMEOUT_S`, 120 s) for the engine's sinks and
        as long again for this process's, giving up on a sink that wrote nothing for 20 s
        (say a tracker that is down).  After 3 s it says what it waits for.  Every row it had
        to drop is told: a WARNING naming the sink and the count.

        Returns, per sink, how many rows were written and dropped (:class:`SinkStats`).
        """
        total = STOP_TIMEOUT_S if timeout is None else max(0.0, float(timeout))
        stall = min(STALL_S, max(total, 0.5))
        with self._lock:
            if not self._started:
                return self.sink_stats
            self._started, self._stopped = False, True
            transport, relay, steplogger = self._transport, self._relay, self._steplogger
            assert transport is not None and relay is not None and steplogger is not None
            if self._finalizer is not None:
                drop_exit_finalizer(self._finalizer)
            if self._unhook is not None:
                self._unhook()
            if transport.forked:
                # a forked child: the engine and the sinks are the parent's
                transport.forget()
                relay.forget()
                return self.sink_stats
            relay.close(min(total, 10.0))
            gather = self._gather
            if gather is not None and not gather.in_engine:
                if collective:  # gathered here: the last rows come back raw and meet here
                    transport.drain(total)
                    gather.flush(total)
                gather.close()
            # gathered by the engines: they meet the other ranks' last rows as they stop
            engine_stats = transport.stop(total, stall, collective, outcome)
            if gather is not None:
                gather.close()
            client_dropped = relay.dropped + transport.dropped_marks
            self._dropped_marks = client_dropped + transport.engine_dropped_marks
            local_stats = steplogger.close(total, stall, outcome)
            stats = {**engine_stats, **local_stats}
            names = unique_names(self._settings.sinks)
            self.sink_stats = {n: stats[n] for n in names if n in stats}
            self.sink_stats.update({n: s for n, s in stats.items() if n not in self.sink_stats})
            if client_dropped:
                logger.warning("gpulens: %d step mark(s) were dropped on their way to the "
                               "engine (it did not keep up); their steps have no rows of "
                               "their own", client_dropped)
            if self._wandb_alone:
                tell_wandb_run_missed()
            self._transport = self._relay = self._steplogger = self._link = None
            self._gather = None
            return self.sink_stats

    # -- live view ---------------------------------------------------------------------------
    def latest(self) -> dict[str, float]:
        """The newest sample of each metric, keyed like rows; ``{}`` if stopped or silent 2 s."""
        transport = self._transport
        return transport.latest(2.0) if transport is not None and self._started else {}

    def processes(self) -> list[GpuProcess]:
        """The processes on the watched GPUs, by GPU then process id (for live views such as
        ``gpulens watch``): process id, GPU, GPU memory held (GB of 1e9 bytes, ``None`` where
        the driver does not say), and, for processes this one can see, name, user and command
        line.  Read by the engine from NVML's process lists (with ``isolation="thread"``, on the
        calling thread: not from the training loop); ``[]`` when not running or no answer in 2 s."""
        transport = self._transport
        return transport.processes(2.0) if transport is not None and self._started else []

    @property
    def dropped_marks(self) -> int:
        """Step marks dropped on their way to rows (their steps fold into the next row's
        window; ``stop()`` warns if any)."""
        transport, relay = self._transport, self._relay
        if transport is None or relay is None:
            return self._dropped_marks
        return relay.dropped + transport.dropped_marks + transport.engine_dropped_marks


def _prepare(sinks: Sequence[SinkSpec | Sink]) -> list[tuple[str, SinkSpec | Sink]]:
    """Each sink with its name in the run (:func:`~gpulens.sinks.unique_names`), prepared
    (:func:`~gpulens.sinks.prepare_sinks`): every cheap check made before anything is made."""
    return list(zip(unique_names(sinks), prepare_sinks(sinks), strict=True))


def _stop_dropped(link: _Link, relay: MarkRelay) -> None:
    """A running monitor was garbage-collected, or the interpreter exits with it running: write
    what it holds and end its engine, as ``stop(collective=False)`` would, within a few
    seconds.  Where the collection happened on one of gpulens's own threads (the link thread,
    a sink's), which this would wait for, it is done in a thread of its own."""
    if threading.current_thread().name.startswith("gpulens-"):
        threading.Thread(target=_stop_quietly, args=(link, relay), name="stop-dropped-monitor",
                         daemon=False).start()
        return
    _stop_quietly(link, relay)


def _stop_quietly(link: _Link, relay: MarkRelay) -> None:
    """Last-resort cleanup (:func:`_stop_dropped`); a forked child only lets go of the engine."""
    transport, writer, gather = link.transport, link.writer, link.gather
    if transport is None or writer is None:
        return
    try:
        if transport.forked:
            transport.forget()
            relay.forget()
            return
        relay.close(1.0)
        if gather is not None and not gather.in_engine:
            gather.close()  # before the engine: no row comes back to it once it closes
        outcome = exit_outcome()  # a script's uncaught exception, at exit
        transport.stop(2.0, 2.0, False, outcome)
        if gather is not None:
            gather.close()
        writer.close(2.0, 2.0, outcome)
    except Exception as exc:
        logger.warning("gpulens: stopping a monitor that was dropped without stop() failed: "
                       "%r", exc)
