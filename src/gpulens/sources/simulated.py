"""Simulated GPUs that speak NVML: the backend of ``GPULENS_BACKEND=simulated``, and the public
test double :class:`gpulens.testing.SimulatedNVML`.

:class:`SimulatedNVML` has the functions of ``pynvml`` that gpulens uses, with the same
arguments, return shapes and errors, so ``gpulens.sources.nvml`` and the sampler run exactly as
they do on hardware.  The GPUs are lively but deterministic and self-consistent:

* activity follows ``load(gpu, t)`` (default: a slow wave with a different phase per GPU);
* power is idle power plus activity times the dynamic range, capped at the limit;
* the energy counter is the exact integral of power (it updates every 100 ms, like NVML's);
* memory used never exceeds memory total;
* the driver's buffered samples exist (power every 20 ms for 2.4 s, utilization every
  1/6 s for 14 s), and GPM gives SM / tensor activity between two samples.

Faults can be injected: ``not_supported`` (per GPU, a set of pynvml function names that raise
NotSupported), ``fail_after`` (per GPU, function names that start failing with an unknown
error after some seconds: a metric that stops reading mid-run), ``lose_gpu_after`` (per GPU,
seconds after which every call raises GPU_IS_LOST) and ``driver_loaded=False`` (``nvmlInit``
fails like a machine without a driver).  ``mig`` gives GPUs MIG instances.  ``processes``
says which processes run on each GPU; by default the process that made the simulator runs on
every GPU and holds all its used memory but the driver's 0.5 GiB.

A simulator is picklable when its load is (see :mod:`gpulens.sources.loads`): it then crosses
into gpulens's engine process, so tests run the very path users run.  Time is counted from
:attr:`SimulatedNVML.epoch`, a ``time.monotonic()`` reading taken when the simulator is made,
so the test (in the training process) and the engine process agree on what happens when.

Example::

    from gpulens import Monitor
    from gpulens.testing import SimulatedNVML, Square

    sim = SimulatedNVML(gpus=2, load=Square(period=2.0, high=1.0, low=0.05))
    with Monitor(backend=sim, sinks=["jsonl:run.jsonl"]) as mon:
        ...
"""

from __future__ import annotations

import math
import os
import random
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpulens.sources.loads import LoadFn, Wave

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999
NVML_DEVICE_MIG_ENABLE = 1
NVML_GPM_METRICS_GET_VERSION = 1
NVML_TOTAL_POWER_SAMPLES = 0
NVML_GPU_UTILIZATION_SAMPLES = 1
NVML_VALUE_TYPE_UNSIGNED_INT = 1

_GIB = 1024**3


class NVMLError(Exception):
    """Raised like pynvml's NVMLError, with the NVML return code in ``value``."""

    def __init__(self, value: int) -> None:
        super().__init__(f"simulated NVML error {value}")
        self.value = value


@dataclass(frozen=True)
class _Handle:
    index: int
    """The GPU (parent GPU of a MIG instance)."""
    mig: int = -1
    """The MIG instance's number on its GPU; -1 for a whole GPU."""


@dataclass
class _Memory:
    total: int
    used: int
    free: int


@dataclass
class _Util:
    gpu: int
    memory: int


@dataclass
class _Pci:
    busId: str


@dataclass
class _ProcessInfo:
    pid: int
    usedGpuMemory: int | None


@dataclass
class _Value:
    uiVal: int


@dataclass
class _Sample:
    timeStamp: int
    sampleValue: _Value


@dataclass
class _GpmSupport:
    isSupportedDevice: int


@dataclass
class _GpmSample:
    refresh: int = -1
    """Which refresh of the GPU's GPM counters the sample saw."""
    gpu: int = -1
    integral: float = 0.0
    t: float = 0.0
    """Up to when (seconds after the epoch) ``integral`` holds the activity; never before 0."""


@dataclass
class _GpmMetric:
    metricId: int = 0
    nvmlReturn: int = 0
    value: float = 0.0


@dataclass
class GpmMetricsGet:
    """Stands for ``pynvml.c_nvmlGpmMetricsGet_t``."""

    version: int = 0
    numMetrics: int = 0
    sample1: Any = None
    sample2: Any = None
    metrics: list[_GpmMetric] = field(default_factory=lambda: [_GpmMetric() for _ in range(16)])


class SimulatedNVML:
    """A stand-in for the ``pynvml`` module with ``gpus`` simulated H100-class GPUs.

    Args:
        gpus: number of GPUs.
        load: activity in [0, 1] as a function of (gpu index, seconds since :attr:`epoch`);
            default :class:`~gpulens.testing.loads.Wave`.  Pass a shape from
            :mod:`gpulens.testing.loads` or a module-level function so the simulator pickles.
        not_supported: per GPU index, pynvml function names that raise NotSupported.
        fail_after: per GPU index, ``{function name: seconds}``: from then on that function
            raises an unknown NVML error (a metric that stops reading mid-run).
        lose_gpu_after: per GPU index, seconds after which every call raises GPU_IS_LOST.
        driver_loaded: ``False`` makes ``nvmlInit`` fail (no driver).
        gpm: whether the GPUs support GPM (Hopper and newer do).
        mig: per GPU index, the profiles of its MIG instances (e.g. ``["3g.40gb"]``): MIG mode
            is on for that GPU and each instance has a ``MIG-...`` UUID (:meth:`mig_uuid`).
        seed: seeds what the hardware does not tell: the phases of the energy counter's and
            GPM's refreshes, and GPM's delay (``None``: drawn afresh).
        energy_latency_s: (min, max) seconds an energy counter read takes (3-15 ms on an
            H200): each read sleeps a time drawn from that range.
        gpm_delay_s: how late a GPM refresh shows activity (``None``: drawn from 0.06-0.12 s;
            an H200 showed ~0.09 s).
        clock: the time source (``time.monotonic``); tests may pass their own (a clock that
            does not pickle keeps the simulator in the training process).
        processes: per GPU index, ``(pid, GPU memory bytes or None)`` of the processes NVML
            lists on it (compute processes); ``None``: the process that made the simulator,
            on every GPU, holding the used memory less 0.5 GiB.

    Like the hardware, and unlike what gpulens assumes: power samples are averages over their
    20 ms period; the energy counter changes every 100 ms at its own phase; GPM refreshes every
    100 ms at its own phase and shows the activity of a period that ended ``gpm_delay_s``
    earlier.
    """

    IS_SIMULATED = True
    NVMLError = NVMLError
    NVML_GPM_METRICS_GET_VERSION = NVML_GPM_METRICS_GET_VERSION
    c_nvmlGpmMetricsGet_t = GpmMetricsGet

    IDLE_W = 70.0
    MAX_W = 700.0
    MEM_TOTAL = 80 * _GIB
    POWER_PERIOD = 0.02
    UTIL_PERIOD = 0.2
    ENERGY_PERIOD = 0.1
    GPM_PERIOD = 0.1

    def __init__(
        self,
        gpus: int = 2,
        *,
        load: LoadFn | None = None,
        not_supported: Mapping[int, Iterable[str]] | None = None,
        fail_after: Mapping[int, Mapping[str, float]] | None = None,
        lose_gpu_after: Mapping[int, float] | None = None,
        driver_loaded: bool = True,
        gpm: bool = True,
        mig: Mapping[int, Sequence[str]] | None = None,
        seed: int | None = None,
        energy_latency_s: tuple[float, float] = (0.003, 0.015),
        gpm_delay_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        processes: Mapping[int, Sequence[tuple[int, int | None]]] | None = None,
        node: str = "",
        nvlink_gb_per_s: float = 0.0,
    ) -> None:
        if gpus < 0:
            raise ValueError(f"gpus must be >= 0, got {gpus}")
        self.gpus = gpus
        self.load: LoadFn = load or Wave()
        self.not_supported = {int(k): set(v) for k, v in (not_supported or {}).items()}
        self.fail_after = {int(k): dict(v) for k, v in (fail_after or {}).items()}
        self.lose_gpu_after = dict(lose_gpu_after or {})
        self.driver_loaded = driver_loaded
        self.gpm = gpm
        self.mig = {int(k): list(v) for k, v in (mig or {}).items()}
        self.clock = clock
        self.processes = ({int(k): list(v) for k, v in processes.items()}
                          if processes is not None else None)
        self.node = node
        """A node name folded into the GPUs' UUIDs: simulators of two "nodes" on one host have
        different GPUs."""
        self.nvlink_gb_per_s = nvlink_gb_per_s
        """NVLink data each GPU sends and receives while busy, GB/s (GPM's NVLink rates; 0, a
        measured 0, by default: a GPU without peers)."""
        self.owner_pid = os.getpid()
        """The process that made the simulator (it runs on every GPU unless ``processes``)."""
        self.epoch = clock()
        """The simulator's time zero (a reading of ``clock``), taken when it is made."""
        rng = random.Random(seed)
        self.energy_phase_s = rng.uniform(0.0, self.ENERGY_PERIOD)
        self.gpm_phase_s = rng.uniform(0.0, self.GPM_PERIOD)
        self.gpm_delay_s = gpm_delay_s if gpm_delay_s is not None else rng.uniform(0.06, 0.12)
        self.energy_latency_s = energy_latency_s
        self._rng = rng
        self._initialized = False
        self._unix_offset = 0.0
        self.calls: dict[str, int] = {}
        self._energy_cache: dict[int, tuple[float, float]] = {}

    # -- the model -------------------------------------------------------------------------
    def elapsed(self) -> float:
        """Seconds since :attr:`epoch` (the ``t`` that loads are functions of)."""
        return self.clock() - self.epoch

    _now = elapsed

    def activity(self, gpu: int, t: float) -> float:
        """The simulated activity of ``gpu`` at ``t`` seconds after the epoch, in [0, 1]."""
        return min(1.0, max(0.0, float(self.load(gpu, t))))

    def power_w(self, gpu: int, t: float) -> float:
        """Board power in watts."""
        return self.IDLE_W + (self.MAX_W - self.IDLE_W) * self.activity(gpu, t)

    def energy_j(self, gpu: int, t: float) -> float:
        """Exact-to-1 ms integral of :meth:`power_w` from the epoch to ``t``."""
        start, total = self._energy_cache.get(gpu, (0.0, 0.0))
        step = 0.001
        if t < start:  # a little behind the cache (the counter lags): integrate backwards
            n = int((start - t) / step) + 1
            back = start - n * step
            extra = sum(self.power_w(gpu, back + (k + 0.5) * step) * step for k in range(n))
            return total - extra + self.power_w(gpu, back) * (t - back)
        n = int((t - start) / step)
        for k in range(n):
            total += self.power_w(gpu, start + (k + 0.5) * step) * step
        start += n * step
        self._energy_cache[gpu] = (start, total)
        return total + self.power_w(gpu, start) * (t - start)

    def _mem_used(self, gpu: int) -> int:
        """Memory in use on ``gpu`` now, in bytes."""
        return int(min(self.MEM_TOTAL, (4 + 60 * self.activity(gpu, self._now())) * _GIB))

    def mig_uuid(self, gpu: int, instance: int) -> str:
        """The UUID of MIG instance ``instance`` of ``gpu``."""
        return f"MIG-5105a7ed-0001-4000-8000-{gpu:04d}{instance:08d}"

    def gpu_uuid(self, gpu: int) -> str:
        """The UUID of ``gpu`` (its node's name folded in, where the simulator has one)."""
        node = zlib.crc32(self.node.encode()) & 0xFFFF if self.node else 0
        return f"GPU-5105a7ed-{node:04x}-4000-8000-{gpu:012d}"

    def _check(self, name: str, handle: _Handle | None = None) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if not self._initialized:
            raise NVMLError(1)  # NVML_ERROR_UNINITIALIZED
        if handle is None:
            return
        now = self._now()
        lost = self.lose_gpu_after.get(handle.index)
        if lost is not None and now >= lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if name in self.not_supported.get(handle.index, ()):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        failing = self.fail_after.get(handle.index, {}).get(name)
        if failing is not None and now >= failing:
            raise NVMLError(NVML_ERROR_UNKNOWN)

    # -- pynvml's functions ------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if not self.driver_loaded:
            raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)
        if not self._initialized:
            self._initialized = True
            self._unix_offset = time.time() - time.monotonic()

    def nvmlShutdown(self) -> None:
        self.calls["nvmlShutdown"] = self.calls.get("nvmlShutdown", 0) + 1

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < self.gpus:
            raise NVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT
        return _Handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        self._check("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in range(self.gpus):
            if text == self.gpu_uuid(gpu):
                return _Handle(gpu)
            for k in range(len(self.mig.get(gpu, ()))):
                if text == self.mig_uuid(gpu, k):
                    return _Handle(gpu, k)
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    # MIG
    def nvmlDeviceGetMigMode(self, h: _Handle) -> list[int]:
        self._check("nvmlDeviceGetMigMode", h)
        mode = NVML_DEVICE_MIG_ENABLE if self.mig.get(h.index) else 0
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: _Handle) -> int:
        self._check("nvmlDeviceGetMaxMigDeviceCount", h)
        return 7 if self.mig.get(h.index) else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: _Handle, index: int) -> _Handle:
        self._check("nvmlDeviceGetMigDeviceHandleByIndex", h)
        if not 0 <= index < len(self.mig.get(h.index, ())):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return _Handle(h.index, index)

    def nvmlDeviceIsMigDeviceHandle(self, h: _Handle) -> int:
        self._check("nvmlDeviceIsMigDeviceHandle")
        return int(h.mig >= 0)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h: _Handle) -> _Handle:
        self._check("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        if h.mig < 0:
            raise NVMLError(2)
        return _Handle(h.index)

    def nvmlDeviceGetName(self, h: _Handle) -> str:
        self._check("nvmlDeviceGetName", h)
        if h.mig >= 0:
            return f"Simulated H100 80GB HBM3 MIG {self.mig[h.index][h.mig]}"
        return "Simulated H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        self._check("nvmlDeviceGetUUID", h)
        return self.mig_uuid(h.index, h.mig) if h.mig >= 0 else self.gpu_uuid(h.index)

    def nvmlDeviceGetPciInfo(self, h: _Handle) -> _Pci:
        self._check("nvmlDeviceGetPciInfo", h)
        return _Pci(busId=f"00000000:{0x18 + h.index:02X}:00.0")
    def nvmlDeviceGetMemoryInfo(self, h: _Handle) -> _Memory:
        self._check("nvmlDeviceGetMemoryInfo", h)
        used = self._mem_used(h.index)
        return _Memory(total=self.MEM_TOTAL, used=used, free=self.MEM_TOTAL - used)

    def nvmlDeviceGetComputeRunningProcesses(self, h: _Handle) -> list[_ProcessInfo]:
        self._check("nvmlDeviceGetComputeRunningProcesses", h)
        if self.processes is not None:
            return [_ProcessInfo(pid, used) for pid, used in self.processes.get(h.index, ())]
        return [_ProcessInfo(self.owner_pid, max(0, self._mem_used(h.index) - _GIB // 2))]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: _Handle) -> list[_ProcessInfo]:
        self._check("nvmlDeviceGetGraphicsRunningProcesses", h)
        return []

    def nvmlDeviceGetUtilizationRates(self, h: _Handle) -> _Util:
        self._check("nvmlDeviceGetUtilizationRates", h)
        a = self.activity(h.index, self._now())
        return _Util(gpu=round(100 * min(1.0, a * 1.05)), memory=round(30 * a))

    def nvmlDeviceGetPowerUsage(self, h: _Handle) -> int:
        self._check("nvmlDeviceGetPowerUsage", h)
        return round(1000 * self.power_w(h.index, self._now()))

    def nvmlDeviceGetEnforcedPowerLimit(self, h: _Handle) -> int:
        self._check("nvmlDeviceGetEnforcedPowerLimit", h)
        return round(1000 * self.MAX_W)

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h: _Handle) -> int:
        self._check("nvmlDeviceGetPowerManagementDefaultLimit", h)
        return round(1000 * self.MAX_W)

    def nvmlDeviceGetMaxClockInfo(self, h: _Handle, clock_type: int) -> int:
        self._check("nvmlDeviceGetMaxClockInfo", h)
        return 1980

    def nvmlDeviceGetTemperature(self, h: _Handle, sensor: int) -> int:
        self._check("nvmlDeviceGetTemperature", h)
        return round(32 + 45 * self.activity(h.index, self._now()))

    def nvmlDeviceGetClockInfo(self, h: _Handle, clock_type: int) -> int:
        self._check("nvmlDeviceGetClockInfo", h)
        if clock_type == 2:  # NVML_CLOCK_MEM: HBM3 at its one clock
            return 2619
        a = self.activity(h.index, self._now())
        return 345 if a < 0.02 else (1980 - (180 if a > 0.9 else 0))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: _Handle) -> int:
        self._check("nvmlDeviceGetCurrentClocksEventReasons", h)
        a = self.activity(h.index, self._now())
        if a < 0.02:
            return 0x1  # GPU idle
        return 0x4 if a > 0.9 else 0x0  # software power cap near the limit

    def power_avg_w(self, gpu: int, end: float, period: float) -> float:
        """Mean power over ``[end - period, end]`` (1 ms steps): what a driver sample says."""
        n = max(1, round(period / 0.001))
        step = period / n
        start = end - period
        return sum(self.power_w(gpu, start + (k + 0.5) * step) for k in range(n)) / n

    def nvmlDeviceGetTotalEnergyConsumption(self, h: _Handle) -> int:
        self._check("nvmlDeviceGetTotalEnergyConsumption", h)
        lo, hi = self.energy_latency_s
        if hi > 0:
            time.sleep(self._rng.uniform(lo, hi))
        t = self._now()
        period, phase = self.ENERGY_PERIOD, self.energy_phase_s
        updated = math.floor((t - phase) / period) * period + phase
        return round(1000 * self.energy_j(h.index, max(0.0, updated)))

    def nvmlDeviceGetSamples(
        self, h: _Handle, sampling_type: int, since_us: int
    ) -> tuple[int, list[_Sample]]:
        self._check("nvmlDeviceGetSamples", h)
        now = self._now()
        if sampling_type == NVML_TOTAL_POWER_SAMPLES:
            period, history = self.POWER_PERIOD, 2.4
        elif sampling_type == NVML_GPU_UTILIZATION_SAMPLES:
            period, history = self.UTIL_PERIOD, 14.0
        else:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        unix0 = self.epoch + self._unix_offset
        first = max(0, math.ceil((now - history) / period))
        last = math.floor(now / period)
        samples: list[_Sample] = []
        for k in range(first, last + 1):
            t = k * period
            ts = int((unix0 + t) * 1e6)
            if ts <= since_us:
                continue
            if sampling_type == NVML_TOTAL_POWER_SAMPLES:  # the mean of the period ending at t
                value = round(1000 * self.power_avg_w(h.index, t, period))
            else:  # the share of the period ending at t that a kernel ran
                n = 20
                busy = sum(min(1.0, 1.05 * self.activity(h.index, t - period + (j + 0.5) *
                                                         period / n)) for j in range(n)) / n
                value = round(100 * busy)
            samples.append(_Sample(ts, _Value(value)))
        if not samples:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return NVML_VALUE_TYPE_UNSIGNED_INT, samples

    def nvmlGpmQueryDeviceSupport(self, h: _Handle) -> _GpmSupport:
        self._check("nvmlGpmQueryDeviceSupport", h)
        return _GpmSupport(isSupportedDevice=int(self.gpm))

    def nvmlGpmSampleAlloc(self) -> _GpmSample:
        return _GpmSample()

    def nvmlGpmSampleFree(self, sample: _GpmSample) -> None:
        return None

    def nvmlGpmSampleGet(self, h: _Handle, sample: _GpmSample) -> _GpmSample:
        """Like the hardware: the counters refresh every ``GPM_PERIOD`` s (at their own phase)
        and a refresh holds the activity up to ``gpm_delay_s`` before it."""
        self._check("nvmlGpmSampleGet", h)
        refresh = math.floor((self._now() - self.gpm_phase_s) / self.GPM_PERIOD)
        t = max(0.0, refresh * self.GPM_PERIOD + self.gpm_phase_s - self.gpm_delay_s)
        sample.refresh, sample.gpu, sample.t = refresh, h.index, t
        # integral of activity from init: the energy integral is its affine image
        sample.integral = (self.energy_j(h.index, t) - self.IDLE_W * t) / (
            self.MAX_W - self.IDLE_W
        )
        return sample

    def nvmlGpmMetricsGet(self, request: GpmMetricsGet) -> GpmMetricsGet:
        self.calls["nvmlGpmMetricsGet"] = self.calls.get("nvmlGpmMetricsGet", 0) + 1
        s1, s2 = request.sample1, request.sample2
        # the span the two refreshes hold: refresh periods, less what lies before the epoch
        # (a sample taken less than gpm_delay_s after it holds activity from the epoch on)
        span = s2.t - s1.t
        if s2.refresh <= s1.refresh or span <= 0:
            # no refresh between the samples: 0s, and 0/0 for DRAM bandwidth
            per_metric = {2: 0.0, 3: 0.0, 5: 0.0, 10: math.nan}
        else:
            mean = min(1.0, max(0.0, (s2.integral - s1.integral) / span))
            per_metric = {2: 100 * mean, 3: 14 * mean, 5: 93 * mean, 10: 16 * mean}
            # interconnect rates (MiB/s): NVLink while busy, a little PCIe (inputs, logging)
            nvlink = self.nvlink_gb_per_s * mean * 1e9 / 1048576
            pcie = 0.5 * mean * 1e9 / 1048576
            per_metric.update({60: nvlink, 61: nvlink, 20: pcie, 21: pcie})
        for m in request.metrics[: request.numMetrics]:
            if m.metricId in per_metric:
                m.value, m.nvmlReturn = per_metric[m.metricId], NVML_SUCCESS
            else:
                m.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
        return request
