"""The one door to NVML.

Only this module calls NVML.  It takes the library as an argument (``lib``): the real
``pynvml`` module from nvidia-ml-py, or :class:`gpulens.testing.SimulatedNVML`, which has the
same functions.  Either way the sampler runs exactly this code, so tests exercise the real path.

Every read goes through :meth:`NvmlDevice._call`, which

* turns NVML errors into a value or "not available" (``None``), never 0;
* remembers per device which reads are NotSupported (or not found in an older driver, or not
  permitted) and never calls them again;
* raises :class:`~gpulens.errors.GpuLost` when the GPU fell off the bus;
* warns once per cause for any other error.

Units are in the names: ``_w`` watts, ``_mj`` millijoules, ``_gb`` 1e9 bytes, ``_mhz``, ``_c``.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gpulens._warn import logger, warn_once
from gpulens.errors import GpuLost, NvmlUnavailable
from gpulens.sinks.base import GpuInfo

T = TypeVar("T")

# Clock-event ("throttle") reason bits, from nvml.h.
_SW_POWER_CAP = 0x4
_HW_SLOWDOWN = 0x8
_SW_THERMAL = 0x20
_HW_THERMAL = 0x40
_HW_POWER_BRAKE = 0x80
POWER_REASONS = _SW_POWER_CAP | _HW_POWER_BRAKE
THERMAL_REASONS = _SW_THERMAL | _HW_THERMAL
THROTTLE_REASONS = POWER_REASONS | THERMAL_REASONS | _HW_SLOWDOWN

_GB = 1e9

# NVML error codes (nvml.h) that mean "this read will never work on this device".
_ERR_NOT_SUPPORTED = 3
_ERR_NO_PERMISSION = 4
_ERR_NOT_FOUND = 6
_ERR_FUNCTION_NOT_FOUND = 13
_ERR_GPU_IS_LOST = 15
_PERMANENT = {_ERR_NOT_SUPPORTED, _ERR_NO_PERMISSION, _ERR_FUNCTION_NOT_FOUND}

# GPM metric ids (nvml.h) -> schema keys.
GPM_METRICS: dict[int, str] = {
    2: "sm_active_pct",  # NVML_GPM_METRIC_SM_UTIL
    3: "sm_occupancy_pct",  # NVML_GPM_METRIC_SM_OCCUPANCY
    5: "tensor_active_pct",  # NVML_GPM_METRIC_ANY_TENSOR_UTIL
    10: "dram_bw_pct",  # NVML_GPM_METRIC_DRAM_BW_UTIL
}

_GPM_REFRESH_KEY = "dram_bw_pct"  # NaN when the counters did not refresh between two samples
GPM_DELAY_S = 0.09
"""How long before it is read the activity shown by a GPM refresh ended (H200, driver
580.159: a 1 s busy phase showed up ~90 ms late; see benchmarks/gpm_probe.py)."""

POWER_SAMPLES = 0  # NVML_TOTAL_POWER_SAMPLES, values in mW
UTIL_SAMPLES = 1  # NVML_GPU_UTILIZATION_SAMPLES, values in percent


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _sample_value(value_type: int, value: Any) -> float:
    """The number inside a ``c_nvmlValue_t`` union, by NVML's value type."""
    field = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}.get(
        value_type, "uiVal"
    )
    return float(getattr(value, field))


@dataclass(frozen=True)
class FastRead:
    """The cheap reads of one sample (each ``None`` where not available)."""

    util_pct: float | None
    mem_used_gb: float | None
    mem_pct: float | None
    power_w: float | None
    power_limit_w: float | None
    temp_c: float | None
    sm_clock_mhz: float | None
    reasons: int | None
    """Clock-event reason bit mask."""


class NvmlDevice:
    """One GPU behind the door.  Made by :meth:`NvmlSource.device`."""

    def __init__(self, lib: Any, handle: Any, nvml_index: int) -> None:
        self._lib = lib
        self._handle = handle
        self.nvml_index = nvml_index
        self._unsupported: set[str] = set()
        self._last_sample_us: dict[int, int] = {}
        self._gpm_prev: Any = None
        self._gpm_prev_t = 0.0
        self._gpm_spare: Any = None
        self._gpm_ok: bool | None = None
        self._mem_total_gb: float | None = None
        self.lost = False

    # -- the one helper every read goes through -------------------------------------------
    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T | None:
        if what in self._unsupported:
            return None
        if self.lost:
            raise GpuLost(f"GPU {self.nvml_index} was lost")
        try:
            return fn(*args)
        except self._lib.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in _PERMANENT:
                self._unsupported.add(what)
                logger.info("GPU %d: %s not available (%s); not asked again", self.nvml_index,
                            what, exc)
                return None
            if code == _ERR_GPU_IS_LOST:
                self.lost = True
                raise GpuLost(f"GPU {self.nvml_index} fell off the bus ({what})") from exc
            if code == _ERR_NOT_FOUND:
                return None
            warn_once(f"nvml:{self.nvml_index}:{what}:{code}",
                      "gpulens: NVML %s failed on GPU %d: %s", what, self.nvml_index, exc)
            return None

    def supports(self, what: str) -> bool:
        """False once ``what`` was found NotSupported on this device."""
        return what not in self._unsupported

    # -- static facts ---------------------------------------------------------------------
    def info(self, index: int) -> GpuInfo:
        """Name, UUID, PCI bus id, memory and power limit, keyed as GPU ``index`` in rows."""
        lib, h = self._lib, self._handle
        name = self._call("name", lib.nvmlDeviceGetName, h)
        uuid = self._call("uuid", lib.nvmlDeviceGetUUID, h)
        pci = self._call("pci", lib.nvmlDeviceGetPciInfo, h)
        mem = self._call("memory", lib.nvmlDeviceGetMemoryInfo, h)
        limit = self._call("power_limit", lib.nvmlDeviceGetEnforcedPowerLimit, h)
        if mem is not None:
            self._mem_total_gb = mem.total / _GB
        return GpuInfo(
            index=index,
            name=_text(name) if name is not None else "unknown",
            uuid=_text(uuid) if uuid is not None else "",
            pci_bus_id=_text(pci.busId) if pci is not None else "",
            mem_total_gb=self._mem_total_gb,
            power_limit_w=limit / 1000.0 if limit is not None else None,
        )

    # -- cheap reads, every sample --------------------------------------------------------
    def read_fast(
        self, *, util: bool = True, power: bool = True, limit: bool = True
    ) -> FastRead:
        """Memory, temperature, SM clock, clock-event reasons; and utilization, power and the
        power limit unless told not to (the sampler skips what the driver's buffered samples
        already give, and reads the static limit once a second)."""
        lib, h = self._lib, self._handle
        util_rates = self._call("utilization", lib.nvmlDeviceGetUtilizationRates, h) if util \
            else None
        mem = self._call("memory", lib.nvmlDeviceGetMemoryInfo, h)
        power_mw = self._call("power", lib.nvmlDeviceGetPowerUsage, h) if power else None
        limit_mw = self._call("power_limit", lib.nvmlDeviceGetEnforcedPowerLimit, h) if limit \
            else None
        temp = self._call("temperature", lib.nvmlDeviceGetTemperature, h, 0)
        clock = self._call("sm_clock", lib.nvmlDeviceGetClockInfo, h, 1)
        reasons_fn = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if reasons_fn is None:  # nvidia-ml-py before 12.535
            reasons_fn = lib.nvmlDeviceGetCurrentClocksThrottleReasons
        reasons = self._call("clock_events", reasons_fn, h)
        used_gb = mem.used / _GB if mem is not None else None
        return FastRead(
            util_pct=float(util_rates.gpu) if util_rates is not None else None,
            mem_used_gb=used_gb,
            mem_pct=100.0 * mem.used / mem.total if mem is not None and mem.total else None,
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
            temp_c=float(temp) if temp is not None else None,
            sm_clock_mhz=float(clock) if clock is not None else None,
            reasons=int(reasons) if reasons is not None else None,
        )

    # -- costly reads, slow cadence -------------------------------------------------------
    def read_energy_mj(self) -> float | None:
        """NVML's total energy counter in millijoules (2.5-12 ms a call on an H200)."""
        value = self._call("energy", self._lib.nvmlDeviceGetTotalEnergyConsumption, self._handle)
        return float(value) if value is not None else None

    def read_samples(self, kind: int) -> list[tuple[float, float]]:
        """The driver's buffered samples of ``kind`` since the last call, as (unix s, value).

        Power samples come in watts, utilization samples in percent.
        """
        what = "power_samples" if kind == POWER_SAMPLES else "util_samples"
        since = self._last_sample_us.get(kind, 0)
        got = self._call(what, self._lib.nvmlDeviceGetSamples, self._handle, kind, since)
        if not got:
            return []
        value_type, samples = got
        scale = 0.001 if kind == POWER_SAMPLES else 1.0
        out = [
            (s.timeStamp / 1e6, _sample_value(value_type, s.sampleValue) * scale)
            for s in samples
            if s.timeStamp > since
        ]
        if out:
            self._last_sample_us[kind] = max(s.timeStamp for s in samples)
            out.sort()
        return out

    def read_gpm(self) -> tuple[float, float, dict[str, float]] | None:
        """GPM metrics since the GPU's counters last refreshed: (start, end, values), monotonic s.

        Measured on an H200 (driver 580.159): the GPM counters refresh about every 100 ms, and
        what a refresh shows is the activity of the period that ended about 90 ms earlier.
        Two samples taken between the same two refreshes show no change: every metric reads 0
        and DRAM bandwidth reads NaN (0/0), while a refreshed idle GPU reads DRAM bandwidth 0.
        So a NaN DRAM figure means "no refresh yet": the earlier sample is kept and ``None`` is
        returned, and spans always run from one seen refresh to the next, placed
        ``GPM_DELAY_S`` earlier than they were read.  (Sampling every 100 ms without this
        check gave alternating 0 % and 2x figures.)

        The first call only takes a sample and returns ``None``; ``None`` too where the GPU has
        no GPM (before Hopper), which is remembered.
        """
        lib, h = self._lib, self._handle
        if self._gpm_ok is None:
            support = self._call("gpm", lib.nvmlGpmQueryDeviceSupport, h)
            self._gpm_ok = bool(support is not None and support.isSupportedDevice)
            if self._gpm_ok:
                self._gpm_prev = lib.nvmlGpmSampleAlloc()
                self._gpm_spare = lib.nvmlGpmSampleAlloc()
                self._gpm_prev_t = time.monotonic()
                if self._call("gpm", lib.nvmlGpmSampleGet, h, self._gpm_prev) is None:
                    self._gpm_ok = False
            return None
        if not self._gpm_ok or not self.supports("gpm"):
            return None
        current = self._gpm_spare
        now = time.monotonic()
        if self._call("gpm", lib.nvmlGpmSampleGet, h, current) is None:
            return None
        request = lib.c_nvmlGpmMetricsGet_t()
        request.version = lib.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1 = self._gpm_prev
        request.sample2 = current
        for i, metric_id in enumerate(GPM_METRICS):
            request.metrics[i].metricId = metric_id
        if self._call("gpm", lib.nvmlGpmMetricsGet, request) is None:
            return None
        values: dict[str, float] = {}
        refreshed = False
        for i, key in enumerate(GPM_METRICS.values()):
            metric = request.metrics[i]
            if metric.nvmlReturn != 0:
                continue
            value = float(metric.value)
            if key == _GPM_REFRESH_KEY:
                refreshed = not math.isnan(value)
            if not math.isnan(value):
                values[key] = value
        if not refreshed:
            return None  # the counters have not refreshed since the kept sample
        start = self._gpm_prev_t
        self._gpm_spare, self._gpm_prev, self._gpm_prev_t = self._gpm_prev, current, now
        return start - GPM_DELAY_S, now - GPM_DELAY_S, values

    def close(self) -> None:
        """Free the GPM samples."""
        for sample in (self._gpm_prev, self._gpm_spare):
            if sample is not None:
                with contextlib.suppress(Exception):  # freeing never matters for training
                    self._lib.nvmlGpmSampleFree(sample)
        self._gpm_prev = self._gpm_spare = None


def parse_visible_devices(value: str | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list of entries (indices, ``GPU-<uuid>``, ``MIG-``).

    ``None`` when unset (all GPUs visible).  Parsing stops at the first invalid entry, as CUDA
    does.
    """
    if value is None:
        return None
    out: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry or entry == "-1":
            break
        out.append(entry)
    return out


class NvmlSource:
    """Opens NVML (the real library, or one handed in) and hands out devices."""

    def __init__(self, lib: Any | None = None) -> None:
        self._given = lib
        self._lib: Any = None
        self.is_simulated = lib is not None and getattr(lib, "IS_SIMULATED", False)

    @property
    def name(self) -> str:
        """``"simulated"`` or ``"nvml"``."""
        return "simulated" if self.is_simulated else "nvml"

    def open(self) -> None:
        """Initialise NVML; :class:`NvmlUnavailable` when there is no library or driver."""
        lib: Any = self._given
        if lib is None:
            try:
                import pynvml
            except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a core dependency
                raise NvmlUnavailable("nvidia-ml-py is not installed") from exc
            lib = pynvml
        try:
            lib.nvmlInit()
        except Exception as exc:
            raise NvmlUnavailable(f"NVML could not be initialised: {exc}") from exc
        self._lib = lib

    def close(self) -> None:
        """Shut NVML down (safe to call twice)."""
        if self._lib is not None:
            with contextlib.suppress(Exception):
                self._lib.nvmlShutdown()
            self._lib = None

    def device_count(self) -> int:
        """How many GPUs NVML sees (all of the node's, whatever CUDA_VISIBLE_DEVICES says)."""
        return int(self._lib.nvmlDeviceGetCount())

    def visible_nvml_indices(self, env: str | None = None) -> list[int]:
        """NVML indices of the GPUs this process can see, in CUDA's order.

        Honours ``CUDA_VISIBLE_DEVICES`` given as indices or as (prefixes of) UUIDs.
        """
        count = self.device_count()
        entries = parse_visible_devices(
            os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
        )
        if entries is None:
            return list(range(count))
        uuids = [_text(self._lib.nvmlDeviceGetUUID(self._lib.nvmlDeviceGetHandleByIndex(i)))
                 for i in range(count)]
        out: list[int] = []
        for entry in entries:
            if entry.isdigit():
                idx = int(entry)
                if idx >= count:
                    break
                out.append(idx)
                continue
            matches = [i for i, u in enumerate(uuids) if u.startswith(entry) or
                       u.removeprefix("GPU-").startswith(entry.removeprefix("GPU-"))]
            if len(matches) != 1:
                break
            out.append(matches[0])
        return out

    def device(self, nvml_index: int) -> NvmlDevice:
        """The device at NVML index ``nvml_index``."""
        handle = self._lib.nvmlDeviceGetHandleByIndex(nvml_index)
        return NvmlDevice(self._lib, handle, nvml_index)
