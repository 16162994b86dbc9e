"""Settings: everything a user chooses for a monitor, as one frozen value.

::

    settings = Settings(interval=0.2, sinks=["jsonl:runs/gpu.jsonl", "mlflow"], dtype="bf16")
    monitor = Monitor.from_settings(settings)
    other = Monitor.from_settings(dataclasses.replace(settings, sinks=["wandb"]))

A value is checked when it is made (``dataclasses.replace`` makes a new one, checked again):
a bad choice is a one-line ``ValueError`` then, before anything starts.  Sink names are parsed
into :class:`~gpulens.sinks.SinkSpec` s there (the one parser of :mod:`gpulens.sinks`: nothing
imported, nothing made).  :class:`gpulens.Monitor` takes the same arguments and builds one;
the framework callbacks, the Hydra config reader and the command line build one the same way,
so an argument is checked once, by the same code, wherever it comes from.

What the environment chooses (``GPULENS_BACKEND``, ``GPULENS_SIMULATED_GPUS``,
``GPULENS_ISOLATION``) is read when the monitor starts, not here.
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpulens.log import warn_once
from gpulens.sinks import SinkSpec, as_sink
from gpulens.sinks.base import Sink

BACKENDS = ("auto", "nvml", "simulated")
ISOLATIONS = ("auto", "process", "thread")


def normalize_run_dtype(dtype: Any) -> str | None:
    """A dtype given in any of the usual spellings (``"bf16"``, ``torch.bfloat16``, a
    Lightning precision such as ``"bf16-mixed"``) as gpulens names it; ``None``: none given,
    or one gpulens does not know (said once: no MFU then, never a borrowed peak)."""
    if dtype is None:
        return None
    from gpulens.work.precision import dtype_from_lightning_precision, normalize_dtype

    name = normalize_dtype(dtype) or dtype_from_lightning_precision(dtype)
    if name is None:
        warn_once(f"dtype:{dtype!r}", "gpulens: dtype %r is not one gpulens knows (bf16, "
                  "fp16, fp32, tf32, fp8, int8, fp64); no MFU", dtype)
    return name


@dataclass(frozen=True)
class Settings:
    """What a :class:`gpulens.Monitor` samples and where it writes; see ``Monitor`` for each
    argument.  Fields hold the checked, normalised values (a list becomes a tuple, a sink name
    a :class:`~gpulens.sinks.SinkSpec`, a dtype its canonical name)."""

    gpus: tuple[int, ...] | None = None
    """CUDA device numbers to watch, as this process numbers them; ``None``: every visible
    GPU, or this rank's in a distributed job."""
    interval: float = 0.5
    """Seconds between cheap samples, > 0."""
    sinks: tuple[SinkSpec | Sink, ...] = ()
    """Where rows go: specs (parsed from names) and sink objects, in the order given."""
    backend: Any = None
    """``None`` (``GPULENS_BACKEND``, else automatic), ``"auto"``, ``"nvml"``, ``"simulated"``
    or an NVML-like object."""
    buffer_rows: int = 10_000
    """Rows each sink may fall behind before the oldest are dropped (counted)."""
    distributed: bool | None = None
    """Gather the ranks' rows on rank 0; ``None``: when torch.distributed runs with >1 rank."""
    gpm: bool = True
    energy: bool = True
    driver_samples: bool = True
    """The costly reads that may be switched off (GPM, the energy counter, the driver's
    buffered samples)."""
    isolation: str = "auto"
    """``"auto"``, ``"process"`` or ``"thread"``: where the engine runs."""
    dtype: str | None = None
    """The run's compute dtype, canonical (``"bf16"`` ...); ``None``: unknown (no MFU)."""
    flops_per_token: float | None = None
    flops_per_sample: float | None = None
    """Model FLOPs (forward + backward) per token / per sample, > 0."""
    require_gpu: bool = False
    """No GPU to monitor is a ``ValueError`` at start, not a warning (``gpulens watch``)."""
    wall_clock: bool = False
    """Each ``log()`` is a tick of a clock, not a training step (``gpulens record``,
    ``serve``): no per-step figures, only the advice rules about the hardware."""

    def __post_init__(self) -> None:
        put = object.__setattr__
        interval = self.interval
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise ValueError(f"interval must be a number of seconds, got {interval!r}")
        if not math.isfinite(interval) or interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        put(self, "interval", float(interval))
        if self.gpus is not None:
            gpus = tuple(self.gpus)
            for g in gpus:
                if isinstance(g, bool) or not isinstance(g, int) or g < 0:
                    raise ValueError(f"gpus must be CUDA device numbers >= 0, got {g!r}")
            put(self, "gpus", gpus)
        sinks: Any = self.sinks
        if isinstance(sinks, (str, bytes, SinkSpec, Sink)):
            sinks = [sinks]
        if not isinstance(sinks, Iterable):
            raise ValueError(f"sinks must be a list of sink names or objects, got {sinks!r}")
        put(self, "sinks", tuple(as_sink(s) for s in sinks))
        backend = self.backend
        if isinstance(backend, str):
            if backend.lower() not in BACKENDS:
                raise ValueError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)} "
                                 "or an NVML-like object")
            put(self, "backend", backend.lower())
        if isinstance(self.buffer_rows, bool) or not isinstance(self.buffer_rows, int) \
                or self.buffer_rows < 1:
            raise ValueError(f"buffer_rows must be a whole number >= 1, got "
                             f"{self.buffer_rows!r}")
        if self.distributed is not None and not isinstance(self.distributed, bool):
            raise ValueError(f"distributed must be True, False or None, got "
                             f"{self.distributed!r}")
        for name in ("gpm", "energy", "driver_samples", "require_gpu", "wall_clock"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        isolation = self.isolation
        if not isinstance(isolation, str) or isolation.lower() not in ISOLATIONS:
            raise ValueError(f"isolation {isolation!r}: expected one of {', '.join(ISOLATIONS)}")
        put(self, "isolation", isolation.lower())
        put(self, "dtype", normalize_run_dtype(self.dtype))
        for name in ("flops_per_token", "flops_per_sample"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
            put(self, name, float(value))


def env_choice(name: str, choices: tuple[str, ...]) -> str | None:
    """The choice an environment variable makes (``GPULENS_BACKEND``, ``GPULENS_ISOLATION``),
    lower-cased; ``None`` if unset; ``ValueError`` (one line) if not one of ``choices``."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


ENGINE_NICE = 0
"""How much nicer than the training process its engine process runs by default
(``GPULENS_ENGINE_NICE``, 0-19).  Nicer, the kernel runs the training's threads before the
engine's where CPUs are busy: on a 2-core VM kept busy by training, nice 10 took the engine's
start beside the user's W&B run out of the first second (+119 ms against +748 over 20 steps)
and cost more in the steps after: its work comes later, not less
(``benchmarks/results/2026-11-29-cpu-engine-priority``, ``with-aa``).  But a nicer engine
falls behind on a loaded host: with three busy processes beside it, at nice 10 a script
that ended without ``stop()`` lost its W&B rows (the exit's 2 s ran out before the sink
opened) and ``gpulens watch`` printed ``n/a`` (the two checks failed 5 times of 6), at 0 never
(``benchmarks/results/2026-11-29-cpu-engine-nice-under-load``).  So 0.  (What made that start
costly on an H200 host was, by its signature, NumPy's OpenBLAS spinning a thread per CPU in
the engine: :data:`gpulens.transport.spawn.ENGINE_ONE_THREAD`; not yet measured on a GPU.)"""


def engine_nice() -> int:
    """:data:`ENGINE_NICE`, or ``GPULENS_ENGINE_NICE`` (``ValueError``, one line, if it is
    not a whole number from 0 to 19)."""
    raw = os.environ.get("GPULENS_ENGINE_NICE", "").strip()
    if not raw:
        return ENGINE_NICE
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ValueError(f"GPULENS_ENGINE_NICE={raw!r}: expected a whole number from 0 to 19 "
                         "(how much nicer than training the engine process runs)")
    return value


def isolation_asked(settings: Settings) -> str:
    """``"process"``, ``"thread"`` or ``"auto"``: the setting, or ``GPULENS_ISOLATION`` where
    the setting is ``"auto"`` (``ValueError``, one line, for a value it does not know)."""
    if settings.isolation != "auto":
        return settings.isolation
    return env_choice("GPULENS_ISOLATION", ISOLATIONS) or "auto"


def backend_for(settings: Settings) -> Any:
    """The backend a monitor of ``settings`` hands its engine: ``"auto"``, ``"nvml"`` or an
    NVML-like object (``GPULENS_BACKEND`` where the setting is ``None``)."""
    backend = settings.backend
    if backend is None:
        backend = env_choice("GPULENS_BACKEND", BACKENDS) or "auto"
    if backend == "simulated":
        return simulated_from_env()
    return backend


def isolation_for(settings: Settings, backend: Any) -> tuple[str, str | None]:
    """Where a monitor of ``settings`` runs its engine with ``backend``: ``("process", None)``
    or ``("thread", why)``, ``why`` being the reason a thread was taken where a process is the
    default (``None`` when a thread was asked for, or is the only choice: not POSIX).
    ``ValueError`` (one line) where a process
    was asked for and cannot be (not POSIX, a backend object that does not pickle), for an
    unknown ``GPULENS_ISOLATION``, or, for a process, a bad ``GPULENS_ENGINE_NICE``."""
    choice = isolation_asked(settings)
    if choice == "thread":
        return "thread", None
    if os.name != "posix":
        if choice == "process":
            raise ValueError("isolation='process' is only available on POSIX systems")
        return "thread", None
    if not isinstance(backend, str):
        try:
            pickle.dumps(backend)
        except Exception as exc:
            if choice == "process":
                raise ValueError(
                    f"isolation='process' needs a backend that pickles ({exc}); give a "
                    "simulator a load from gpulens.testing (Square, Steps ...) or a "
                    "module-level function, or use isolation='thread'") from None
            return "thread", f"the backend object does not pickle ({exc})"
    engine_nice()  # a bad GPULENS_ENGINE_NICE is the user's to mend: said at start
    return "process", None


def simulated_from_env() -> Any:
    """The simulated GPUs ``GPULENS_BACKEND=simulated`` asks for (``GPULENS_SIMULATED_GPUS``,
    default 2; 0 is a machine where no NVIDIA driver answers, to test the path without GPUs)."""
    from gpulens.sources.simulated import SimulatedNVML

    raw = os.environ.get("GPULENS_SIMULATED_GPUS", "2")
    try:
        count = int(raw)
    except ValueError:
        raise ValueError(f"GPULENS_SIMULATED_GPUS={raw!r} is not a whole number") from None
    if count < 0:
        raise ValueError(f"GPULENS_SIMULATED_GPUS={raw!r} must be 0 (a machine without a "
                         "driver) or more")
    # 0: no driver answers; a node name of its own (GPULENS_NODE_NAME): two simulated "nodes"
    # on one host
    return SimulatedNVML(gpus=count, driver_loaded=count > 0,
                         node=os.environ.get("GPULENS_NODE_NAME", ""))


def distributed_env() -> tuple[int, int, int] | None:
    """(global rank, local rank, world size) from torchrun's variables, or None if single."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world
    except (KeyError, ValueError):
        return None
