"""Simulated GPUs that speak NVML.

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
NotSupported), ``lose_gpu_after`` (per GPU, seconds after init after which every call raises
GPU_IS_LOST) and ``driver_loaded=False`` (``nvmlInit`` fails like a machine without a driver).

Example::

    from gpulens import Monitor
    from gpulens.testing import SimulatedNVML

    sim = SimulatedNVML(gpus=2, load=lambda gpu, t: 1.0 if int(t) % 2 == 0 else 0.05)
    with Monitor(backend=sim, sinks=["jsonl:run.jsonl"]) as mon:
        ...
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

LoadFn = Callable[[int, float], float]

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_GPU_IS_LOST = 15
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


def default_load(gpu: int, t: float) -> float:
    """A lively, deterministic activity in [0, 1]: a 7 s wave with a per-GPU phase."""
    return 0.55 + 0.4 * math.sin(2 * math.pi * (t / 7.0 + gpu / 8.0))


@dataclass
class _Handle:
    index: int


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
        load: activity in [0, 1] as a function of (gpu index, seconds since ``nvmlInit``).
        not_supported: per GPU index, pynvml function names that raise NotSupported.
        lose_gpu_after: per GPU index, seconds after init after which the GPU is lost.
        driver_loaded: ``False`` makes ``nvmlInit`` fail (no driver).
        gpm: whether the GPUs support GPM (Hopper and newer do).
        clock: the time source (``time.monotonic``); tests may pass their own.
    """

    IS_SIMULATED = True
    NVMLError = NVMLError
    NVML_GPM_METRICS_GET_VERSION = NVML_GPM_METRICS_GET_VERSION
    c_nvmlGpmMetricsGet_t = GpmMetricsGet

    IDLE_W = 70.0
    MAX_W = 700.0
    MEM_TOTAL = 80 * _GIB
    POWER_PERIOD = 0.02
    UTIL_PERIOD = 1 / 6
    ENERGY_PERIOD = 0.1
    GPM_PERIOD = 0.1
    GPM_DELAY = 0.09

    def __init__(
        self,
        gpus: int = 2,
        *,
        load: LoadFn | None = None,
        not_supported: Mapping[int, Iterable[str]] | None = None,
        lose_gpu_after: Mapping[int, float] | None = None,
        driver_loaded: bool = True,
        gpm: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if gpus < 0:
            raise ValueError(f"gpus must be >= 0, got {gpus}")
        self.gpus = gpus
        self.load = load or default_load
        self.not_supported = {int(k): set(v) for k, v in (not_supported or {}).items()}
        self.lose_gpu_after = dict(lose_gpu_after or {})
        self.driver_loaded = driver_loaded
        self.gpm = gpm
        self.clock = clock
        self._t0: float | None = None
        self._unix_offset = 0.0
        self.calls: dict[str, int] = {}
        self._energy_cache: dict[int, tuple[float, float]] = {}

    # -- the model -------------------------------------------------------------------------
    def _now(self) -> float:
        assert self._t0 is not None
        return self.clock() - self._t0

    def activity(self, gpu: int, t: float) -> float:
        """The simulated activity of ``gpu`` at ``t`` seconds after init, clamped to [0, 1]."""
        return min(1.0, max(0.0, float(self.load(gpu, t))))

    def power_w(self, gpu: int, t: float) -> float:
        """Board power in watts."""
        return self.IDLE_W + (self.MAX_W - self.IDLE_W) * self.activity(gpu, t)

    def energy_j(self, gpu: int, t: float) -> float:
        """Exact-to-1 ms integral of :meth:`power_w` from init to ``t``."""
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

    def _check(self, name: str, handle: _Handle | None = None) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self._t0 is None:
            raise NVMLError(1)  # NVML_ERROR_UNINITIALIZED
        if handle is None:
            return
        lost = self.lose_gpu_after.get(handle.index)
        if lost is not None and self._now() >= lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if name in self.not_supported.get(handle.index, ()):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)

    # -- pynvml's functions ------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if not self.driver_loaded:
            raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)
        if self._t0 is None:
            self._t0 = self.clock()
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

    def nvmlDeviceGetName(self, h: _Handle) -> str:
        self._check("nvmlDeviceGetName", h)
        return "Simulated H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        self._check("nvmlDeviceGetUUID", h)
        return f"GPU-5105a7ed-0000-4000-8000-{h.index:012d}"

    def nvmlDeviceGetPciInfo(self, h: _Handle) -> _Pci:
        self._check("nvmlDeviceGetPciInfo", h)
        return _Pci(busId=f"00000000:{0x18 + h.index:02X}:00.0")

    def nvmlDeviceGetMemoryInfo(self, h: _Handle) -> _Memory:
        self._check("nvmlDeviceGetMemoryInfo", h)
        t = self._now()
        used = int(min(self.MEM_TOTAL, (4 + 60 * self.activity(h.index, t)) * _GIB))
        return _Memory(total=self.MEM_TOTAL, used=used, free=self.MEM_TOTAL - used)

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

    def nvmlDeviceGetTemperature(self, h: _Handle, sensor: int) -> int:
        self._check("nvmlDeviceGetTemperature", h)
        return round(32 + 45 * self.activity(h.index, self._now()))

    def nvmlDeviceGetClockInfo(self, h: _Handle, clock_type: int) -> int:
        self._check("nvmlDeviceGetClockInfo", h)
        a = self.activity(h.index, self._now())
        return 345 if a < 0.02 else (1980 - (180 if a > 0.9 else 0))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: _Handle) -> int:
        self._check("nvmlDeviceGetCurrentClocksEventReasons", h)
        a = self.activity(h.index, self._now())
        if a < 0.02:
            return 0x1  # GPU idle
        return 0x4 if a > 0.9 else 0x0  # software power cap near the limit

    def nvmlDeviceGetTotalEnergyConsumption(self, h: _Handle) -> int:
        self._check("nvmlDeviceGetTotalEnergyConsumption", h)
        t = self._now()
        updated = math.floor(t / self.ENERGY_PERIOD) * self.ENERGY_PERIOD
        return round(1000 * self.energy_j(h.index, updated))

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
        assert self._t0 is not None
        unix0 = self._t0 + self._unix_offset
        first = max(0, math.ceil((now - history) / period))
        last = math.floor(now / period)
        samples: list[_Sample] = []
        for k in range(first, last + 1):
            t = k * period
            ts = int((unix0 + t) * 1e6)
            if ts <= since_us:
                continue
            if sampling_type == NVML_TOTAL_POWER_SAMPLES:
                value = round(1000 * self.power_w(h.index, t))
            else:  # utilization over the period that ends at t
                value = round(100 * min(1.0, 1.05 * self.activity(h.index, t - period / 2)))
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
        """Like the hardware: the counters refresh every ``GPM_PERIOD`` s and a refresh holds
        the activity up to ``GPM_DELAY`` s before it."""
        self._check("nvmlGpmSampleGet", h)
        refresh = math.floor(self._now() / self.GPM_PERIOD)
        t = max(0.0, refresh * self.GPM_PERIOD - self.GPM_DELAY)
        sample.refresh, sample.gpu = refresh, h.index
        # integral of activity from init: the energy integral is its affine image
        sample.integral = (self.energy_j(h.index, t) - self.IDLE_W * t) / (
            self.MAX_W - self.IDLE_W
        )
        return sample

    def nvmlGpmMetricsGet(self, request: GpmMetricsGet) -> GpmMetricsGet:
        self.calls["nvmlGpmMetricsGet"] = self.calls.get("nvmlGpmMetricsGet", 0) + 1
        s1, s2 = request.sample1, request.sample2
        span = (s2.refresh - s1.refresh) * self.GPM_PERIOD
        if span <= 0:  # no refresh between the samples: 0s, and 0/0 for DRAM bandwidth
            per_metric = {2: 0.0, 3: 0.0, 5: 0.0, 10: math.nan}
        else:
            mean = min(1.0, max(0.0, (s2.integral - s1.integral) / span))
            per_metric = {2: 100 * mean, 3: 14 * mean, 5: 93 * mean, 10: 16 * mean}
        for m in request.metrics[: request.numMetrics]:
            if m.metricId in per_metric:
                m.value, m.nvmlReturn = per_metric[m.metricId], NVML_SUCCESS
            else:
                m.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
        return request
