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
import itertools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gpulens.errors import GpuLost, NvmlUnavailable
from gpulens.log import logger, warn_once
from gpulens.model import GpuInfo

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

GPM_RATES: dict[int, str] = {
    21: "pcie_rx_gb_per_s",  # NVML_GPM_METRIC_PCIE_RX_PER_SEC, MiB/s
    20: "pcie_tx_gb_per_s",  # NVML_GPM_METRIC_PCIE_TX_PER_SEC
    60: "nvlink_rx_gb_per_s",  # NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, all links
    61: "nvlink_tx_gb_per_s",  # NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC
}
"""GPM's interconnect rates (MiB/s, given as GB/s): where the GPU has GPM they win over the
counter rates of :meth:`NvmlDevice.read_fast` for the same keys."""
_MIB_PER_S_TO_GB = 1.048576e-3
# Field values (nvml.h): cumulative NVLink data KiB per link, PCIe bytes.
_FI_NVLINK_TX_KIB, _FI_NVLINK_RX_KIB = 138, 139
_FI_PCIE_TX_BYTES, _FI_PCIE_RX_BYTES = 197, 198
_NVLINKS = 18
"""Links asked for (one field call; links a GPU does not have answer with an error)."""

_GPM_REFRESH_KEY = "dram_bw_pct"  # NaN when the counters did not refresh between two samples
GPM_DELAY_S = 0.09
"""How long before it is read the activity shown by a GPM refresh ended (H200, driver
580.159: a 1 s busy phase showed up ~90 ms late; see benchmarks/gpm_probe.py)."""

_MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE

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
    mem_clock_mhz: float | None = None
    links: dict[str, float] | None = None
    """NVLink and PCIe receive/transmit rates since the previous read, GB/s (1e9 bytes), from
    NVML's cumulative counters (``nvlink_rx_gb_per_s`` ...); ``None`` on the first read or
    where the GPU has no such counter."""


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
        self._links_prev: tuple[float, dict[str, float]] | None = None
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
                logger.info("gpulens: GPU %d: %s not available (%s); not asked again",
                            self.nvml_index, what, exc)
                return None
            if code == _ERR_GPU_IS_LOST:
                self.lost = True
                raise GpuLost(f"GPU {self.nvml_index} fell off the bus ({what})") from exc
            if code == _ERR_NOT_FOUND:
                return None
            warn_once(f"nvml:{self.nvml_index}:{what}:{code}",
                      "gpulens: NVML %s failed on GPU %d: %s; that metric is left out while it "
                      "fails", what, self.nvml_index, exc)
            return None

    def supports(self, what: str) -> bool:
        """False once ``what`` was found NotSupported on this device."""
        return what not in self._unsupported

    # -- static facts ---------------------------------------------------------------------
    def info(self, index: int, mig: str | None = None) -> GpuInfo:
        """Name, UUID, PCI bus id, memory and power limit, keyed as GPU ``index`` in rows;
        ``mig`` names the MIG instance this process uses on it, if any."""
        lib, h = self._lib, self._handle
        name = self._call("name", lib.nvmlDeviceGetName, h)
        uuid = self._call("uuid", lib.nvmlDeviceGetUUID, h)
        pci = self._call("pci", lib.nvmlDeviceGetPciInfo, h)
        mem = self._call("memory", lib.nvmlDeviceGetMemoryInfo, h)
        limit = self._call("power_limit", lib.nvmlDeviceGetEnforcedPowerLimit, h)
        default_limit = self._call("default_power_limit",
                                   lib.nvmlDeviceGetPowerManagementDefaultLimit, h)
        max_clock = self._call("max_sm_clock", lib.nvmlDeviceGetMaxClockInfo, h, 1)  # SM
        if mem is not None:
            self._mem_total_gb = mem.total / _GB
        return GpuInfo(
            index=index,
            name=_text(name) if name is not None else "unknown",
            uuid=_text(uuid) if uuid is not None else "",
            pci_bus_id=_text(pci.busId) if pci is not None else "",
            mem_total_gb=self._mem_total_gb,
            power_limit_w=limit / 1000.0 if limit is not None else None,
            mig=mig,
            max_sm_clock_mhz=float(max_clock) if max_clock else None,
            default_power_limit_w=default_limit / 1000.0 if default_limit else None,
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
        mem_clock = self._call("mem_clock", lib.nvmlDeviceGetClockInfo, h, 2)  # NVML_CLOCK_MEM
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
            mem_clock_mhz=float(mem_clock) if mem_clock is not None else None,
            links=self._link_rates(),
        )

    def _link_rates(self) -> dict[str, float] | None:
        """NVLink (data, summed over links) and PCIe byte counters -> rates since the previous
        read, GB/s.  One ``nvmlDeviceGetFieldValues`` call; a counter the GPU lacks is left
        out (and, when none answers, never asked again)."""
        lib = self._lib
        read = getattr(lib, "nvmlDeviceGetFieldValues", None)
        if read is None:  # an NVML-like backend without field values
            return None
        fields = [(_FI_NVLINK_RX_KIB, link) for link in range(_NVLINKS)]
        fields += [(_FI_NVLINK_TX_KIB, link) for link in range(_NVLINKS)]
        fields += [(_FI_PCIE_RX_BYTES, 0), (_FI_PCIE_TX_BYTES, 0)]
        got = self._call("link_counters", read, self._handle, fields)
        if got is None:
            return None
        now = time.monotonic()
        totals: dict[str, float] = {}
        for v in got:
            if v.nvmlReturn != 0:
                continue
            key, scale = {_FI_NVLINK_RX_KIB: ("nvlink_rx_gb_per_s", 1024.0),
                          _FI_NVLINK_TX_KIB: ("nvlink_tx_gb_per_s", 1024.0),
                          _FI_PCIE_RX_BYTES: ("pcie_rx_gb_per_s", 1.0),
                          _FI_PCIE_TX_BYTES: ("pcie_tx_gb_per_s", 1.0)}[int(v.fieldId)]
            totals[key] = totals.get(key, 0.0) + _sample_value(v.valueType, v.value) * scale
        if not totals:
            self._unsupported.add("link_counters")
            return None
        prev, self._links_prev = self._links_prev, (now, totals)
        if prev is None or now <= prev[0]:
            return None
        dt = now - prev[0]
        return {k: (b - prev[1][k]) / dt / _GB for k, b in totals.items()
                if k in prev[1] and b >= prev[1][k]}

    # -- costly reads, slow cadence -------------------------------------------------------
    def read_energy_mj(self) -> float | None:
        """NVML's total energy counter in millijoules (2.5-12 ms a call on an H200)."""
        value = self._call("energy", self._lib.nvmlDeviceGetTotalEnergyConsumption, self._handle)
        return float(value) if value is not None else None

    def probe_energy_update(self, budget_s: float = 0.35) -> float | None:
        """How often the energy counter changes, in seconds: the median time between the
        changes seen while reading it back to back for at most ``budget_s`` (each read takes
        3-15 ms on an H200, so the figure is that coarse).  ``None`` without a counter or
        without two changes in the budget."""
        changes: list[float] = []
        last: float | None = None
        end = time.monotonic() + budget_s
        while time.monotonic() < end and len(changes) < 5:
            before = time.monotonic()
            value = self.read_energy_mj()
            if value is None:
                return None
            t = (before + time.monotonic()) / 2
            if last is not None and value != last:
                changes.append(t)
            last = value
        gaps = sorted(b - a for a, b in itertools.pairwise(changes))
        return gaps[len(gaps) // 2] if gaps else None

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
                self._gpm_prev = self._call("gpm", lib.nvmlGpmSampleAlloc)
                self._gpm_spare = self._call("gpm", lib.nvmlGpmSampleAlloc)
                self._gpm_prev_t = time.monotonic()
                if (self._gpm_prev is None or self._gpm_spare is None
                        or self._call("gpm", lib.nvmlGpmSampleGet, h, self._gpm_prev) is None):
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
        wanted = {**GPM_METRICS, **GPM_RATES}
        request.numMetrics = len(wanted)
        request.sample1 = self._gpm_prev
        request.sample2 = current
        for i, metric_id in enumerate(wanted):
            request.metrics[i].metricId = metric_id
        if self._call("gpm", lib.nvmlGpmMetricsGet, request) is None:
            return None
        values: dict[str, float] = {}
        refreshed = False
        for i, (metric_id, key) in enumerate(wanted.items()):
            metric = request.metrics[i]
            if metric.nvmlReturn != 0:
                continue
            value = float(metric.value)
            if metric_id in GPM_RATES:
                value *= _MIB_PER_S_TO_GB
            if key == _GPM_REFRESH_KEY:
                refreshed = not math.isnan(value)
            if not math.isnan(value):
                values[key] = value
        if not refreshed:
            return None  # the counters have not refreshed since the kept sample
        start = self._gpm_prev_t
        self._gpm_spare, self._gpm_prev, self._gpm_prev_t = self._gpm_prev, current, now
        return start - GPM_DELAY_S, now - GPM_DELAY_S, values

    # -- on demand ----------------------------------------------------------------------
    def read_processes(self) -> list[tuple[int, int | None]]:
        """The processes running on this GPU, compute and graphics, as (pid, GPU memory in
        bytes or ``None`` where the driver does not say); a process in both lists once."""
        from gpulens.sources.processes import used_bytes

        out: dict[int, int | None] = {}
        for what, name in (("compute_processes", "nvmlDeviceGetComputeRunningProcesses"),
                           ("graphics_processes", "nvmlDeviceGetGraphicsRunningProcesses")):
            fn = getattr(self._lib, name, None)
            if fn is None:
                continue
            for p in self._call(what, fn, self._handle) or ():
                used = used_bytes(getattr(p, "usedGpuMemory", None))
                pid = int(p.pid)
                if pid not in out or (out[pid] is None and used is not None):
                    out[pid] = used
        return sorted(out.items())

    def close(self) -> None:
        """Free the GPM samples."""
        for sample in (self._gpm_prev, self._gpm_spare):
            if sample is not None:
                with contextlib.suppress(Exception):  # freeing never matters for training
                    self._lib.nvmlGpmSampleFree(sample)
        self._gpm_prev = self._gpm_spare = None


def parse_visible_devices(value: str | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list of entries (indices, ``GPU-<uuid>``, ``MIG-...``).

    ``None`` when unset (all GPUs visible).  Parsing stops at the first empty entry or ``-1``,
    as CUDA does.
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


@dataclass(frozen=True)
class VisibleGpu:
    """A GPU this process can use, as NVML knows it."""

    nvml_index: int
    """NVML index of the (parent) GPU: its metrics are the ones read."""
    mig: str | None = None
    """The MIG instance this process uses on it (``"MIG 3g.40gb (MIG-...)"``), if any: NVML
    gives utilization, power, temperature and clocks for the whole GPU only."""


class NvmlSource:
    """Opens NVML (the real library, or one handed in) and hands out devices.

    Enumeration goes through :meth:`_call` too: one door for every NVML call.
    """

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

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T | None:
        """An enumeration call: its value, or ``None`` (not supported, not found, or failed:
        failures other than "not supported" are warned about once)."""
        try:
            return fn(*args)
        except self._lib.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code not in _PERMANENT and code != _ERR_NOT_FOUND:
                warn_once(f"nvml-enum:{what}:{code}", "gpulens: NVML %s failed: %s", what, exc)
            return None

    def device_count(self) -> int:
        """How many GPUs NVML sees (all of the node's, whatever CUDA_VISIBLE_DEVICES says)."""
        count = self._call("device count", self._lib.nvmlDeviceGetCount)
        return int(count) if count is not None else 0

    def _handle(self, index: int) -> Any:
        return self._call(f"handle of GPU {index}", self._lib.nvmlDeviceGetHandleByIndex, index)

    def _uuid(self, handle: Any) -> str:
        value = self._call("uuid", self._lib.nvmlDeviceGetUUID, handle)
        return _text(value) if value is not None else ""

    def _mig_instances(self, index: int) -> list[tuple[str, str]]:
        """(UUID, name) of each MIG instance of GPU ``index`` (none without MIG mode)."""
        lib = self._lib
        handle = self._handle(index)
        if handle is None or not hasattr(lib, "nvmlDeviceGetMigMode"):
            return []
        mode = self._call("MIG mode", lib.nvmlDeviceGetMigMode, handle)
        if not mode or int(mode[0]) != _MIG_ENABLED:
            return []
        count = self._call("MIG device count", lib.nvmlDeviceGetMaxMigDeviceCount, handle) or 0
        out: list[tuple[str, str]] = []
        for k in range(int(count)):
            mig = self._call("MIG device", lib.nvmlDeviceGetMigDeviceHandleByIndex, handle, k)
            if mig is None:
                continue
            name = self._call("MIG name", lib.nvmlDeviceGetName, mig)
            text = _text(name) if name is not None else ""
            profile = text[text.find("MIG "):] if "MIG " in text else "MIG instance"
            out.append((self._uuid(mig), profile))
        return out

    def visible_gpus(self, env: str | None = None) -> list[VisibleGpu]:
        """The GPUs this process can see, in CUDA's order.

        Honours ``CUDA_VISIBLE_DEVICES`` given as indices, as (prefixes of) GPU UUIDs, or as
        MIG instances (``MIG-<uuid>``, or the older ``MIG-GPU-<uuid>/<gi>/<ci>``), which map to
        their parent GPU with the instance named.  An entry that matches nothing is warned
        about (CUDA ignores it and every entry after it, and so does this).
        """
        count = self.device_count()
        value = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
        entries = parse_visible_devices(value)
        if entries is None:
            return [VisibleGpu(i) for i in range(count)]
        uuids = [self._uuid(h) if (h := self._handle(i)) is not None else ""
                 for i in range(count)]
        migs: dict[int, list[tuple[str, str]]] | None = None
        out: list[VisibleGpu] = []
        for entry in entries:
            found: VisibleGpu | None = None
            if entry.isdigit():
                if int(entry) < count:
                    found = VisibleGpu(int(entry))
            elif entry.startswith("MIG-"):
                if migs is None:
                    migs = {i: self._mig_instances(i) for i in range(count)}
                found = _match_mig(entry, uuids, migs)
            else:
                matches = [i for i, u in enumerate(uuids) if u and (
                    u.startswith(entry)
                    or u.removeprefix("GPU-").startswith(entry.removeprefix("GPU-")))]
                if len(matches) == 1:
                    found = VisibleGpu(matches[0])
            if found is None:
                known = ", ".join(u for u in uuids if u) or "none"
                mig_known = ", ".join(u for inst in (migs or {}).values() for u, _ in inst)
                logger.warning(
                    "gpulens: CUDA_VISIBLE_DEVICES=%r: entry %r matches no GPU that NVML sees "
                    "(%d GPU(s): %s%s); it and the entries after it are not monitored",
                    value, entry, count, known,
                    f"; MIG instances: {mig_known}" if mig_known else "")
                break
            out.append(found)
        return out

    def visible_nvml_indices(self, env: str | None = None) -> list[int]:
        """NVML indices of the GPUs this process can see, in CUDA's order (see
        :meth:`visible_gpus`)."""
        return [g.nvml_index for g in self.visible_gpus(env)]

    def device(self, nvml_index: int) -> NvmlDevice:
        """The device at NVML index ``nvml_index`` (``GpuLost`` if NVML cannot give it)."""
        handle = self._handle(nvml_index)
        if handle is None:
            raise GpuLost(f"NVML gives no handle for GPU {nvml_index}")
        return NvmlDevice(self._lib, handle, nvml_index)


def _match_mig(entry: str, uuids: list[str],
               migs: dict[int, list[tuple[str, str]]]) -> VisibleGpu | None:
    """The GPU of MIG entry ``entry`` of ``CUDA_VISIBLE_DEVICES``, or ``None``."""
    if entry.startswith("MIG-GPU-"):  # MIG-GPU-<uuid>/<gi>/<ci> (CUDA < 11.4 style)
        gpu_uuid, _, rest = entry.removeprefix("MIG-").partition("/")
        for i, u in enumerate(uuids):
            if u and u.startswith(gpu_uuid):
                gi = rest.partition("/")[0]
                return VisibleGpu(i, f"MIG GPU instance {gi} ({entry})")
        return None
    hits = [(i, uuid, name) for i, inst in migs.items() for uuid, name in inst
            if uuid.startswith(entry)]
    if len(hits) != 1:
        return None
    i, uuid, name = hits[0]
    return VisibleGpu(i, f"{name} ({uuid})")
