"""``Monitor``: the public face of the core (sources -> sampler -> window -> step logger -> sinks).

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
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from gpulens._warn import logger, warn_once
from gpulens.engine.sampler import GpuState, Mark, Sampler
from gpulens.engine.steplogger import SinkStats, StepLogger
from gpulens.errors import NvmlUnavailable
from gpulens.sinks import resolve_sink
from gpulens.sinks.base import Row, RunContext, Sink
from gpulens.sources.host import HostReader
from gpulens.sources.nvml import NvmlSource
from gpulens.sources.torch_alloc import TorchAllocator
from gpulens.transport.process import SamplerProcess, SpawnFailed, remote_spec

BACKENDS = ("auto", "nvml", "simulated")
ISOLATIONS = ("auto", "process", "thread")


def _env_isolation() -> str | None:
    name = os.environ.get("GPULENS_ISOLATION", "").strip().lower()
    if not name:
        return None
    if name not in ISOLATIONS:
        raise ValueError(f"GPULENS_ISOLATION={name!r}: expected one of {', '.join(ISOLATIONS)}")
    return name


def _env_backend() -> Any:
    name = os.environ.get("GPULENS_BACKEND", "").strip().lower()
    if not name:
        return None
    if name not in BACKENDS:
        raise ValueError(f"GPULENS_BACKEND={name!r}: expected one of {', '.join(BACKENDS)}")
    return name


def _simulated_from_env() -> Any:
    from gpulens.testing.simulated import SimulatedNVML

    raw = os.environ.get("GPULENS_SIMULATED_GPUS", "2")
    try:
        count = int(raw)
    except ValueError:
        raise ValueError(f"GPULENS_SIMULATED_GPUS={raw!r} is not a whole number") from None
    if count < 1:
        raise ValueError(f"GPULENS_SIMULATED_GPUS={raw!r} must be at least 1")
    return SimulatedNVML(gpus=count)


def distributed_env() -> tuple[int, int, int] | None:
    """(global rank, local rank, world size) from torchrun's variables, or None if single."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world
    except (KeyError, ValueError):
        return None


class Monitor:
    """Samples this process's GPUs and writes one row per :meth:`log` call to the sinks.

    Args:
        gpus: CUDA device numbers to watch, as this process numbers them (after
            ``CUDA_VISIBLE_DEVICES``).  ``None``: every GPU this process can see, or in a
            distributed job (``WORLD_SIZE`` > 1) only this rank's GPU (``LOCAL_RANK``).
        interval: seconds between cheap samples (utilization, memory, power, temperature,
            clocks); must be > 0.  Energy and the driver's buffered samples are read every
            ``max(1 s, interval)``; GPM, whose counters refresh about every 100 ms, is polled
            every ``max(50 ms, interval / 2)``.
        sinks: names (``"wandb"``, ``"mlflow"``, ``"jsonl:PATH"``, ``"prometheus:PORT"``) or
            objects with ``open``/``write``/``close``.
        backend: ``"nvml"``, ``"simulated"``, ``"auto"``/``None`` (NVML if a driver answers),
            or an NVML-like object such as :class:`gpulens.testing.SimulatedNVML`.  The
            environment variable ``GPULENS_BACKEND`` (with ``GPULENS_SIMULATED_GPUS=N``) picks
            one when the argument is ``None``.
        buffer_rows: rows each sink may fall behind before the oldest are dropped (counted).
        gpm, energy, driver_samples: switch off a costly read (GPM activity; the energy
            counter, 3-15 ms a call on an H200; the driver's buffered power and utilization
            samples, ~2.4 ms).  Without them the figures come from the cheap reads alone:
            no ``sm_active_pct``/``tensor_active_pct``, energy integrated from power.
        distributed: gather the ranks' rows on rank 0 (``None``: when torch.distributed is
            initialised with more than one rank).  Then every rank must call :meth:`log` for
            the same steps: it is a collective.
        isolation: where the sampler runs.  ``"process"``: a process of its own
            (:mod:`gpulens.transport.process`), which also writes the JSONL and MLflow sinks;
            this process only sends step marks down a pipe.  ``"thread"``: a thread of this
            process.  ``"auto"`` (default; ``GPULENS_ISOLATION`` overrides it): a process,
            unless ``backend`` is an object (it cannot cross) or no process can be started
            (then a thread, with a warning).

    Rows are finished by the sampler thread a little after ``log()`` (once the data covering
    the window has been read, at most about ``max(1 s, interval) + 0.2 s``); ``stop()``
    writes all of them.

    :attr:`dropped_marks` counts the ``log()`` calls whose step mark never reached a sampler
    process that could not keep up (their steps fold into the next row's window; ``stop()``
    warns if any); always 0 with the sampler in a thread.
    """

    def __init__(
        self,
        gpus: Sequence[int] | None = None,
        interval: float = 0.5,
        sinks: Iterable[str | Sink] = (),
        backend: Any = None,
        *,
        buffer_rows: int = 10_000,
        distributed: bool | None = None,
        gpm: bool = True,
        energy: bool = True,
        driver_samples: bool = True,
        isolation: str = "auto",
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise ValueError(f"interval must be a number of seconds, got {interval!r}")
        if not math.isfinite(interval) or interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        if gpus is not None:
            gpus = list(gpus)
            for g in gpus:
                if isinstance(g, bool) or not isinstance(g, int) or g < 0:
                    raise ValueError(f"gpus must be CUDA device numbers >= 0, got {g!r}")
        if isinstance(sinks, (str, bytes)):
            sinks = [sinks]
        if buffer_rows < 1:
            raise ValueError(f"buffer_rows must be >= 1, got {buffer_rows!r}")
        self.interval = float(interval)
        self.gpus = gpus
        self.sinks: list[Sink] = [resolve_sink(s) for s in sinks]
        if isinstance(backend, str):
            if backend.lower() not in BACKENDS:
                raise ValueError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)} "
                                 "or an NVML-like object")
            backend = backend.lower()
        self._backend_arg = backend
        self._buffer_rows = buffer_rows
        self._distributed_arg = distributed
        self._reads = {"gpm": gpm, "energy": energy, "driver_samples": driver_samples}
        if not isinstance(isolation, str) or isolation.lower() not in ISOLATIONS:
            raise ValueError(f"isolation {isolation!r}: expected one of {', '.join(ISOLATIONS)}")
        self._isolation_arg = isolation.lower()
        self.isolation: str | None = None
        """``"process"`` or ``"thread"`` once started."""
        self._process: SamplerProcess | None = None
        self._alloc = TorchAllocator()
        self._alloc_due = -math.inf
        self.context: RunContext | None = None
        self.sink_stats: dict[str, SinkStats] = {}
        self._source: NvmlSource | None = None
        self._sampler: Sampler | None = None
        self._steplogger: StepLogger | None = None
        self._gather: Any = None
        self._started = False
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def with_sinks(self, sinks: Iterable[str | Sink]) -> Monitor:
        """A new, unstarted monitor with this one's settings and other sinks.

        Integrations check their arguments by making a monitor when they are constructed and
        make the one they start once they know the run's sinks (rank 0 only, a framework's
        own W&B or MLflow run, ...).
        """
        return Monitor(self.gpus, self.interval, sinks, self._backend_arg,
                       buffer_rows=self._buffer_rows, distributed=self._distributed_arg,
                       isolation=self._isolation_arg, **self._reads)

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._started

    def _open_source(self) -> NvmlSource | None:
        backend = self._backend_arg
        if backend is None:
            backend = _env_backend() or "auto"
        if backend == "simulated":
            source = NvmlSource(_simulated_from_env())
        elif isinstance(backend, str):
            source = NvmlSource()
        else:
            source = NvmlSource(backend)
        try:
            source.open()
        except NvmlUnavailable as exc:
            if backend == "nvml":
                raise ValueError(f"backend='nvml' was asked for, but {exc}") from exc
            warn_once("no-nvml", "gpulens: %s; logging host and training metrics only "
                      "(set GPULENS_BACKEND=simulated for simulated GPUs)", exc)
            return None
        return source

    def _choose_gpus(self, source: NvmlSource) -> list[tuple[int, int, int | None]]:
        """(row key, NVML index, torch index) for each GPU to watch."""
        visible = source.visible_nvml_indices()
        dist = distributed_env()
        if self.gpus is None:
            if dist is not None:
                rank, local_rank, _ = dist
                if not visible:
                    return []
                ordinal = local_rank % len(visible)
                return [(rank, visible[ordinal], ordinal)]
            return [(i, n, i) for i, n in enumerate(visible)]
        out: list[tuple[int, int, int | None]] = []
        for g in self.gpus:
            if g >= len(visible):
                raise ValueError(
                    f"GPU {g} does not exist: this process sees {len(visible)} GPU(s)"
                    + (f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
                       if "CUDA_VISIBLE_DEVICES" in os.environ else "")
                )
            key = dist[0] if dist is not None and len(self.gpus) == 1 else g
            out.append((key, visible[g], g))
        return out

    def start(self, step: int = 0) -> Monitor:
        """Start sampling (a process or a thread, see ``isolation``); open the sinks; take the
        first sample.  Idempotent.

        ``step``: the training step the first window starts after (0 for a fresh run; a
        resumed run passes the step it resumes from), so the first row's per-step figures
        divide by the right number of steps.
        """
        with self._lock:
            if self._started:
                return self
            if self._wants_process():
                try:
                    self._start_process(step)
                except SpawnFailed as exc:
                    warn_once("spawn", "gpulens: %s; sampling in a thread of this process "
                              "instead", exc)
                    self._start_thread(step)
            else:
                self._start_thread(step)
            self._started = True
            assert self.context is not None
            logger.info("gpulens: monitoring %d GPU(s) via %s every %.3g s (sampler in a %s)",
                        len(self.context.gpus), self.context.backend, self.interval,
                        self.isolation)
            return self

    def _wants_process(self) -> bool:
        choice = self._isolation_arg
        if choice == "auto":
            choice = _env_isolation() or "auto"
        if choice == "thread":
            return False
        backend = self._backend_arg
        if backend is not None and not isinstance(backend, str):
            if choice == "process":
                raise ValueError("isolation='process' needs a backend by name ('nvml', "
                                 "'simulated', 'auto'): an NVML-like object cannot cross to "
                                 "another process")
            return False
        if os.name != "posix":
            if choice == "process":
                raise ValueError("isolation='process' is only available on POSIX systems")
            return False
        return True

    def _start_process(self, step: int) -> None:
        self._gather = self._make_gather_early()
        is_writer = self._gather is None or self._gather.is_writer
        sinks = self.sinks if is_writer else []
        # Sinks that can be rebuilt there go to the sampler process, unless rows must meet
        # the other ranks' here first.
        remote: list[tuple[str, dict[str, Any]]] = []
        local: list[Sink] = []
        for sink in sinks:
            spec = remote_spec(sink) if self._gather is None else None
            if spec is None:
                local.append(sink)
            else:
                remote.append(spec)
        config = {
            "gpus": self.gpus, "interval": self.interval, "backend": self._backend_arg,
            "buffer_rows": self._buffer_rows, "reads": self._reads, "step": step,
            "sinks": remote, "rows_back": bool(local) or self._gather is not None,
        }
        steplogger = StepLogger(local, buffer_rows=self._buffer_rows)
        gather = self._gather
        emit = steplogger.submit if gather is None else gather.local_row
        proc = SamplerProcess(config, on_row=emit)
        self.context = proc.start()
        try:
            if gather is not None:
                gather.bind(self.context)
            steplogger.open(self.context)
        except BaseException:
            proc.stop(2.0)
            raise
        self._process, self._steplogger = proc, steplogger
        self._alloc_due = -math.inf
        self._slow = max(1.0, self.interval)
        self.isolation = "process"
        self._finalizer = weakref.finalize(self, _stop_process_quietly, proc, steplogger)

    def _start_thread(self, step: int) -> None:
        source = self._open_source()
        states: list[GpuState] = []
        try:
            if source is not None:
                for key, nvml_index, torch_index in self._choose_gpus(source):
                    device = source.device(nvml_index)
                    states.append(GpuState(key=key, device=device, info=device.info(key),
                                           torch_index=torch_index))
            self.context = RunContext(
                gpus=tuple(s.info for s in states),
                hostname=socket.gethostname(),
                backend=source.name if source is not None else "none",
                interval=self.interval,
            )
            self._gather = self._make_gather()
            is_writer = self._gather is None or self._gather.is_writer
            steplogger = StepLogger(self.sinks if is_writer else [],
                                    buffer_rows=self._buffer_rows)
            steplogger.open(self.context)
        except BaseException:
            if source is not None:
                source.close()
            raise
        self._source, self._steplogger = source, steplogger
        emit = steplogger.submit if self._gather is None else self._gather.local_row
        self._sampler = Sampler(
            states,
            interval=self.interval,
            slow_interval=max(1.0, self.interval),
            emit=emit,
            host=HostReader(),
            torch_alloc=TorchAllocator(),
            **self._reads,
        )
        self._sampler.start(step)
        self.isolation = "thread"
        self._finalizer = weakref.finalize(self, _stop_quietly, self._sampler, steplogger,
                                           source)

    def _make_gather_early(self) -> Any:
        """The gather, made before the run context is known (it comes from the sampler
        process); :meth:`RankGather.bind` completes it."""
        if self._distributed_arg is False:
            return None
        from gpulens.distributed import RankGather, torch_distributed_ready

        if not torch_distributed_ready():
            if self._distributed_arg:
                raise ValueError("distributed=True, but torch.distributed is not initialised "
                                 "with more than one rank")
            return None
        return RankGather(None, submit=lambda row: self._submit(row))

    def _make_gather(self) -> Any:
        gather = self._make_gather_early()
        if gather is not None:
            assert self.context is not None
            gather.bind(self.context)
        return gather

    def _submit(self, row: Row) -> None:
        if self._steplogger is not None:
            self._steplogger.submit(row)

    def log(self, step: int, **scalars: Any) -> None:
        """End the current window at training step ``step`` and write one row.

        ``scalars`` (loss, learning_rate, grad_norm, ...) go into the same row; a name without
        ``/`` is written as ``train/<name>``.  Pass Python numbers; a tensor is converted in
        the background (never synchronised on this thread).  Never blocks on a network.  In a
        distributed job this is a collective: every rank must call it for the same steps.
        """
        if not self._started:
            raise RuntimeError("Monitor.log() before start(); use `with Monitor(...)` or start()")
        now = time.monotonic()
        proc = self._process
        if proc is not None:
            alloc = None
            if now >= self._alloc_due and proc.torch_indices:
                self._alloc_due = now + self._slow
                alloc = self._read_alloc(proc.torch_indices)
            proc.mark(int(step), now, time.time(), scalars, alloc)
        else:
            sampler = self._sampler
            assert sampler is not None
            sampler.marks.append(Mark(int(step), now, time.time(), scalars))
        if self._gather is not None:
            self._gather.exchange()
        if self._steplogger is not None:
            self._steplogger.drain_training_thread()

    def _read_alloc(self, indices: list[int]) -> dict[int, tuple[float, float]] | None:
        """The torch allocator's figures, read here for the sampler process (one host-side
        call per GPU, once a slow period)."""
        out: dict[int, tuple[float, float]] = {}
        for index in indices:
            mem = self._alloc.read(index)
            if mem is not None:
                out[index] = mem
        return out or None

    def stop(self, timeout: float = 10.0) -> dict[str, SinkStats]:
        """Close the last windows, flush every sink (within ``timeout`` s) and stop.  Idempotent.

        Returns, per sink, how many rows were written and dropped.
        """
        with self._lock:
            if not self._started:
                return self.sink_stats
            self._started = False
            assert self._steplogger is not None
            child_stats: dict[str, SinkStats] = {}
            proc = self._process
            if proc is not None and proc.forked:
                # a forked child: the sampler process and the sinks are the parent's
                proc.forget()
                if self._finalizer is not None:
                    self._finalizer.detach()
                self._process = None
                return self.sink_stats
            if proc is not None:
                child_stats = proc.stop(timeout)
                self._dropped_marks = proc.dropped_marks
            else:
                assert self._sampler is not None
                self._sampler.stop()
            if self._gather is not None:
                try:
                    self._gather.flush()
                except Exception as exc:
                    logger.warning("gpulens: gathering the last rows failed: %r", exc)
            stats = dict(child_stats)
            for name, st in self._steplogger.close(timeout).items():
                stats[name if name not in stats else f"{name}#local"] = st
            self.sink_stats = stats
            if self._sampler is not None:
                for state in self._sampler.gpus:
                    state.device.close()
            if self._source is not None:
                self._source.close()
            if self._finalizer is not None:
                self._finalizer.detach()
            self._process = None
            self._sampler = None
            return self.sink_stats

    # -- live view ---------------------------------------------------------------------------
    def latest(self) -> dict[str, float]:
        """The newest sample of each GPU metric, keyed like rows (for live views).

        GPM and buffered figures come from the last completed read.  With the sampler in a
        process of its own this asks it (a round trip of a few milliseconds; ``{}`` if it
        does not answer within 2 s).
        """
        proc = self._process
        if proc is not None:
            return proc.latest()
        sampler = self._sampler
        return sampler.latest() if sampler is not None else {}

    _dropped_marks = 0

    @property
    def dropped_marks(self) -> int:
        """Step marks dropped on their way to the sampler process (see the class doc)."""
        proc = self._process
        return proc.dropped_marks if proc is not None else self._dropped_marks


def _stop_quietly(sampler: Sampler, steplogger: StepLogger, source: NvmlSource | None) -> None:
    """Last-resort cleanup when a Monitor is garbage-collected or the process exits."""
    try:
        sampler.stop(timeout=2.0)
        steplogger.close(timeout=2.0)
        if source is not None:
            source.close()
    except Exception:
        pass


def _stop_process_quietly(proc: SamplerProcess, steplogger: StepLogger) -> None:
    """Last-resort cleanup of a process-isolated Monitor (garbage-collected, process exit).
    In a forked child it only closes that child's copies of the pipe ends: the sampler
    process and the sinks are the parent's."""
    try:
        if proc.forked:
            proc.forget()
            return
        proc.stop(timeout=2.0)
        steplogger.close(timeout=2.0)
    except Exception:
        pass
