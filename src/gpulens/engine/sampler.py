"""The sampler thread: reads the sources on their cadences and closes step windows.

One thread per :meth:`Sampler.start` (so stop-then-start works).  It

* every ``interval`` seconds reads the cheap NVML values of each GPU, the host (psutil) and,
  where this process uses CUDA through torch, the caching allocator (no device sync);
* every ``slow_interval`` seconds reads the energy counter and the driver's buffered power and
  utilization samples (the buffers hold ~2.4 s of power and ~14 s of utilization, so a read a
  second loses nothing);
* every ``gpm_interval`` seconds (half the interval, at least 50 ms) polls GPM (Hopper and
  newer), whose counters refresh about every 100 ms;
* after each pass turns every step mark whose window is covered by data into a
  :class:`~gpulens.sinks.base.Row` and hands it to ``emit``.

The training thread only appends marks to a deque.  NVML's calls go through ctypes, which
releases the GIL while the driver works.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpulens._warn import logger, warn_once
from gpulens.engine.window import IntervalSeries, Series, Table, job_aggregates, window_energy_j
from gpulens.errors import GpuLost
from gpulens.schema import GPU_METRICS, Agg, gpu_key, train_key
from gpulens.sinks.base import GpuInfo, Row
from gpulens.sources.host import HostReader
from gpulens.sources.nvml import (
    GPM_METRICS as GPM_IDS,
)
from gpulens.sources.nvml import (
    POWER_REASONS,
    POWER_SAMPLES,
    THERMAL_REASONS,
    THROTTLE_REASONS,
    UTIL_SAMPLES,
    NvmlDevice,
)
from gpulens.sources.torch_alloc import TorchAllocator

GPM_KEYS = frozenset(GPM_IDS.values())
COUNTER_MIN_SPAN_S = 0.3
"""Energy counter reads closer than this to the previous one are not kept (the counter
updates about every 100 ms)."""

# What each schema metric is made of: (suffix, column of the fast table, take, with max).
# "util_pct" and "power_w" prefer the driver's buffered samples (see ``Sampler.gpu_window``).
_FAST_PLAN: tuple[tuple[str, str, bool, bool], ...] = tuple(
    (m.key, m.key, m.agg is Agg.LAST, m.with_max)
    for m in GPU_METRICS
    if m.key not in ("util_pct", "power_w", "energy_j", "torch_allocated_gb", "torch_peak_gb")
    and m.key not in GPM_KEYS
)


@dataclass
class Mark:
    """A ``log()`` call: the end of one window."""

    step: int
    t: float
    """``time.monotonic()`` at the call."""
    wall: float
    """``time.time()`` at the call."""
    scalars: dict[str, Any]
    """As passed to ``log()``; named (``train/<name>``) and converted in the sampler thread."""
    alloc: dict[int, tuple[float, float]] | None = None
    """Torch allocator (allocated GB, peak GB) per torch device, read by the training process
    at the call (a sampler in a process of its own cannot read it); ``None`` when not read."""


@dataclass
class GpuState:
    """What the sampler keeps for one GPU."""

    key: int
    """The GPU's number in row keys."""
    device: NvmlDevice
    info: GpuInfo
    torch_index: int | None
    fast: Table = field(default_factory=Table)
    """The cheap reads, one row per sample (columns named like schema suffixes)."""
    util_fast: Series = field(default_factory=Series)
    power_fast: Series = field(default_factory=Series)
    """Utilization and power from the cheap reads: appended only while they are read (until the
    driver's buffered samples come), so they go stale, and drop out, when they stop."""
    util_buf: Series = field(default_factory=Series)
    power_buf: Series = field(default_factory=Series)
    energy_mj: Series = field(default_factory=Series)
    gpm: IntervalSeries = field(default_factory=IntervalSeries)
    torch_alloc: Series = field(default_factory=Series)
    torch_peak: Series = field(default_factory=Series)
    """The torch allocator's figures (GB), read every slow period."""
    limit_due: bool = True
    """Read the power limit at the next fast read (set by each slow read)."""
    periods: dict[int, float] = field(default_factory=dict)
    """The driver's sample period of each kind of buffered sample, in seconds."""
    lost: bool = False

    keys: dict[str, str] = field(default_factory=dict)
    """Row key of each suffix (``gpu/{key}/{suffix}``), made once."""

    def row_key(self, suffix: str) -> str:
        full = self.keys.get(suffix)
        if full is None:
            full = self.keys[suffix] = gpu_key(self.key, suffix)
        return full

    def trim_before(self, t: float) -> None:
        self.fast.trim_before(t)
        self.util_fast.trim_before(t)
        self.power_fast.trim_before(t)
        self.util_buf.trim_before(t)
        self.power_buf.trim_before(t)
        self.energy_mj.trim_before(t)
        self.gpm.trim_before(t)
        self.torch_alloc.trim_before(t)
        self.torch_peak.trim_before(t)


class Sampler:
    """Reads GPUs and host on cadences and turns step marks into rows (see module doc)."""

    def __init__(
        self,
        gpus: Sequence[GpuState],
        *,
        interval: float,
        emit: Callable[[Row], None],
        slow_interval: float = 1.0,
        gpm_interval: float | None = None,
        gpm: bool = True,
        energy: bool = True,
        driver_samples: bool = True,
        host: HostReader | None = None,
        torch_alloc: TorchAllocator | None = None,
    ) -> None:
        self.gpus = list(gpus)
        self.interval = interval
        self.slow_interval = max(slow_interval, interval)
        # GPM counters refresh about every 100 ms; polling at half the interval (at least
        # every 50 ms) places each refresh within that much (see NvmlDevice.read_gpm).
        self.gpm_interval = gpm_interval or max(0.05, interval / 2)
        self.gpm = gpm
        self.energy = energy
        self.driver_samples = driver_samples
        self.emit = emit
        self.host = host
        self.torch_alloc = torch_alloc
        self.marks: deque[Mark] = deque()
        self.host_series: dict[str, Series] = {"cpu_pct": Series(), "ram_used_gb": Series()}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._window_start = 0.0
        self._prev_step = 0
        self._last_fast = -math.inf
        self._last_slow = -math.inf
        self._unix_offset = time.time() - time.monotonic()
        self.failed: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, step: int = 0) -> float:
        """Take the first reading on this thread, then start the loop.  Returns window start.

        ``step`` is the training step the first window starts after (0 for a fresh run).
        """
        self._stop.clear()
        self._prev_step = step
        now = time.monotonic()
        self._read_fast(now)
        self._read_slow(now)
        self._read_gpm(now)
        self._window_start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="gpulens-sampler", daemon=True)
        self._thread.start()
        return self._window_start

    def stop(self, timeout: float = 10.0) -> None:
        """Take a last reading, close every pending window, and end the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                warn_once("sampler-stuck", "gpulens: the sampler thread did not stop in %.0f s",
                          timeout)
            self._thread = None

    # -- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        next_fast = time.monotonic() + self.interval
        next_slow = time.monotonic() + self.slow_interval
        next_gpm = time.monotonic() + self.gpm_interval
        while True:
            timeout = max(0.0, min(next_fast, next_slow, next_gpm) - time.monotonic())
            self._wake.wait(timeout)
            self._wake.clear()
            stopping = self._stop.is_set()
            now = time.monotonic()
            if now >= next_fast or stopping:
                self._guard(self._read_fast, now)
                next_fast = max(next_fast + self.interval, now + self.interval / 2)
            if now >= next_gpm or stopping:
                self._guard(self._read_gpm, now)
                next_gpm = max(next_gpm + self.gpm_interval, now + self.gpm_interval / 2)
            if now >= next_slow or stopping:
                self._guard(self._read_slow, now)
                next_slow = max(next_slow + self.slow_interval, now + self.slow_interval / 2)
            # Rows go on (host and training figures, a gap for the GPUs) whatever the reads did.
            self._guard(self._close_final if stopping else self._close_ready, now)
            if stopping:
                return

    def _close_ready(self, now: float) -> None:
        self._close_windows(final=False)

    def _close_final(self, now: float) -> None:
        self._close_windows(final=True)

    def _guard(self, step: Callable[[float], None], now: float) -> None:
        """Run one part of a pass; a failure is warned about once and never stops training."""
        try:
            step(now)
        except Exception as exc:
            self.failed = exc
            warn_once(f"sampler:{type(exc).__name__}:{exc}",
                      "gpulens: sampler failed (%r); GPU metrics have a gap, training goes on",
                      exc)

    # -- reads -------------------------------------------------------------------------------
    def _lose(self, gpu: GpuState, exc: GpuLost) -> None:
        gpu.lost = True
        logger.warning("gpulens: %s; its metrics stop (a gap), training goes on", exc)

    def _read_fast(self, now: float) -> None:
        for gpu in self.gpus:
            if gpu.lost:
                continue
            try:
                # What the driver's buffered samples give is not read again; the enforced power
                # limit once per slow period.
                r = gpu.device.read_fast(
                    util=not gpu.util_buf.t, power=not gpu.power_buf.t,
                    limit=gpu.limit_due or not gpu.fast.t,
                )
                gpu.limit_due = False
            except GpuLost as exc:
                self._lose(gpu, exc)
                continue
            t = time.monotonic()
            row: dict[str, float] = {}
            for key, value in (
                ("mem_used_gb", r.mem_used_gb), ("mem_pct", r.mem_pct),
                ("power_limit_w", r.power_limit_w), ("temp_c", r.temp_c),
                ("sm_clock_mhz", r.sm_clock_mhz),
            ):
                if value is not None:
                    row[key] = value
            if r.util_pct is not None:
                gpu.util_fast.add(t, r.util_pct)
            if r.power_w is not None:
                gpu.power_fast.add(t, r.power_w)
            if r.reasons is not None:
                row["throttle_pct"] = 100.0 if r.reasons & THROTTLE_REASONS else 0.0
                row["throttle_power_pct"] = 100.0 if r.reasons & POWER_REASONS else 0.0
                row["throttle_thermal_pct"] = 100.0 if r.reasons & THERMAL_REASONS else 0.0
            gpu.fast.add_row(t, row)
        self._last_fast = time.monotonic()
        if self.host is not None:
            t = time.monotonic()
            for key, value in self.host.read().items():
                self.host_series[key].add(t, value)

    def _read_slow(self, now: float) -> None:
        offset = self._unix_offset = time.time() - time.monotonic()
        for gpu in self.gpus:
            # The allocator's statistics cost tens of microseconds of Python-visible work
            # each: once a slow period, not at every cheap read.
            if self.torch_alloc is not None and gpu.torch_index is not None:
                mem = self.torch_alloc.read(gpu.torch_index)
                if mem is not None:
                    t = time.monotonic()
                    gpu.torch_alloc.add(t, mem[0])
                    gpu.torch_peak.add(t, mem[1])
            if gpu.lost:
                continue
            try:
                gpu.limit_due = True
                energy = gpu.device.read_energy_mj() if self.energy else None
                t = time.monotonic()
                last = gpu.energy_mj.last_time
                # The counter ticks about every 100 ms: two reads closer than that can show no
                # change for energy that was used (the last pass at stop() comes early).
                if energy is not None and (last is None or t - last >= COUNTER_MIN_SPAN_S):
                    gpu.energy_mj.add(t, energy)
                for kind, series in ((POWER_SAMPLES, gpu.power_buf), (UTIL_SAMPLES, gpu.util_buf)):
                    if not self.driver_samples:
                        break
                    points = gpu.device.read_samples(kind)
                    if not points:
                        continue
                    # A buffered sample is the average over the driver's sample period that
                    # ends at its timestamp (20 ms for power, ~200 ms for utilization on an
                    # H200): it belongs at the middle of that period.
                    period = gpu.periods[kind] = _spacing(points) or gpu.periods.get(kind, 0.0)
                    series.extend([(ts - offset - period / 2, v) for ts, v in points])
            except GpuLost as exc:
                self._lose(gpu, exc)
        self._last_slow = time.monotonic()

    def _read_gpm(self, now: float) -> None:
        if not self.gpm:
            return
        for gpu in self.gpus:
            if gpu.lost:
                continue
            try:
                got = gpu.device.read_gpm()
            except GpuLost as exc:
                self._lose(gpu, exc)
                continue
            if got is not None:
                gpu.gpm.add(*got)

    # -- live view ---------------------------------------------------------------------------
    def latest(self) -> dict[str, float]:
        """The newest sample of each metric, keyed like rows (read from the sampler's series;
        a torn read at worst shows one sample older)."""
        out: dict[str, float] = {}
        for gpu in self.gpus:
            for key, column in list(gpu.fast.cols.items()):
                if column:
                    out[f"gpu/{gpu.key}/{key}"] = column[-1]
            # the newer of the cheap read and the driver's buffered samples
            for key, pair in (("util_pct", (gpu.util_fast, gpu.util_buf)),
                              ("power_w", (gpu.power_fast, gpu.power_buf))):
                fresh = max(pair, key=lambda s: s.last_time or -math.inf)
                if fresh.v:
                    out[f"gpu/{gpu.key}/{key}"] = fresh.v[-1]
            for key, series in (("torch_allocated_gb", gpu.torch_alloc),
                                ("torch_peak_gb", gpu.torch_peak)):
                if series.v:
                    out[f"gpu/{gpu.key}/{key}"] = series.v[-1]
            if gpu.gpm.spans:
                for key, value in gpu.gpm.spans[-1][2].items():
                    out[f"gpu/{gpu.key}/{key}"] = value
        for key, series in self.host_series.items():
            if series.v:
                out[f"host/{key}"] = series.v[-1]
        return out

    # -- windows -----------------------------------------------------------------------------
    def _ready(self, mark: Mark, now: float) -> bool:
        if self._last_fast < mark.t:
            return False
        # The driver's buffers lag the read a little (utilization every ~1/6 s): wait for a
        # slow read a bit past the mark, but never longer than max_lag.
        if self._last_slow >= mark.t + 0.2:
            return True
        return now - mark.t > self.slow_interval + 2 * self.interval + 0.5

    def _close_windows(self, final: bool) -> None:
        now = time.monotonic()
        while self.marks:
            mark = self.marks[0]
            if not final and not self._ready(mark, now):
                break
            self.marks.popleft()
            row = self._row(mark)
            try:
                self.emit(row)
            except Exception as exc:  # a sink problem is the step logger's to count
                warn_once("emit", "gpulens: could not hand a row on: %r", exc)
            # Finishing a row is pure Python under the GIL: yield it after each row, so that
            # the training thread, if it waits for the GIL, waits for one row, not a burst.
            time.sleep(0)
        horizon = self.marks[0].t if self.marks else self._window_start
        horizon -= 2 * self.slow_interval + 1.0
        for gpu in self.gpus:
            gpu.trim_before(horizon)
        for s in self.host_series.values():
            s.trim_before(horizon)

    def gpu_window(self, gpu: GpuState, t0: float, t1: float) -> dict[str, float]:
        """The figures of one GPU over ``[t0, t1)``, keyed by schema suffix."""
        stale = 2 * self.interval + 0.5
        slack = 0.25
        out: dict[str, float] = {}
        last_seen = gpu.fast.last_time
        if (gpu.lost or self.failed is not None) and (last_seen is None or last_seen < t0):
            return out  # a gap: the GPU stopped answering before this window
        got = gpu.fast.window(t0, t1, stale)
        if got is None:
            return out
        fast, count = got
        for suffix, column, take_last, with_max in _FAST_PLAN:
            st = fast.get(column)
            if st is None:
                continue
            out[suffix] = st.last if take_last else st.mean
            if with_max:
                out[suffix + "_max"] = st.max
        # utilization and power: the driver's buffered samples where they cover the window
        util_series = gpu.util_buf if gpu.util_buf.covers(t0, t1, slack) else gpu.util_fast
        util = util_series.stat(t0, t1, stale)
        if util is not None:
            out["util_pct"] = util.mean
        power_series = gpu.power_buf if gpu.power_buf.covers(t0, t1, slack) else gpu.power_fast
        if not power_series.t:  # buffered samples that do not cover, and no fast power read
            power_series = gpu.power_buf
        power = power_series.stat(t0, t1, stale) if power_series.t else None
        if power is not None:
            out["power_w"] = power.mean
            out["power_w_max"] = power.max
        energy = window_energy_j(gpu.energy_mj, power_series if power_series.t else None, t0, t1)
        if energy is not None:
            out["energy_j"] = energy
        out.update(gpu.gpm.means(t0, t1, stale))
        alloc_stale = self.slow_interval + stale
        for suffix, series in (("torch_allocated_gb", gpu.torch_alloc),
                               ("torch_peak_gb", gpu.torch_peak)):
            value = _last_at(series, t1, alloc_stale)
            if value is not None:
                out[suffix] = value
        out["samples"] = float(count)
        return out

    def _row(self, mark: Mark) -> Row:
        t0, t1 = self._window_start, mark.t
        if mark.alloc:
            for gpu in self.gpus:
                mem = mark.alloc.get(gpu.torch_index) if gpu.torch_index is not None else None
                if mem is not None:
                    gpu.torch_alloc.add(t1, mem[0])
                    gpu.torch_peak.add(t1, mem[1])
        self._window_start = t1
        steps = max(1, mark.step - self._prev_step)
        self._prev_step = mark.step
        values: dict[str, float] = {}
        energy_total = 0.0
        have_energy = False
        per_gpu: list[dict[str, float]] = []
        for gpu in self.gpus:
            figures = self.gpu_window(gpu, t0, t1)
            keys = gpu.keys
            for suffix, value in figures.items():
                full = keys.get(suffix)
                if full is None:
                    full = gpu.row_key(suffix)
                values[full] = value
            if figures:
                per_gpu.append(figures)
            if "energy_j" in figures:
                energy_total += figures["energy_j"]
                have_energy = True
        values.update(job_aggregates(per_gpu))
        stale = 2 * self.interval + 0.5
        for key, series in self.host_series.items():
            st = series.stat(t0, t1, stale)
            if st is not None:
                values[f"host/{key}"] = st.mean
        values["perf/steps"] = float(steps)
        values["perf/step_time_s"] = (t1 - t0) / steps
        if have_energy:
            values["perf/energy_per_step_j"] = energy_total / steps
        for name, value in mark.scalars.items():
            number = _to_float(value)
            if number is not None:
                values[train_key(name)] = number
        values["train/global_step"] = float(mark.step)
        return Row(step=mark.step, time=mark.wall, values=values)


def _last_at(series: Series, t: float, stale: float) -> float | None:
    """The newest sample at or before ``t``, if it is at most ``stale`` seconds old."""
    i = bisect_right(series.t, t) - 1
    if i < 0 or t - series.t[i] > stale:
        return None
    return series.v[i]


def _spacing(points: list[tuple[float, float]]) -> float:
    """The driver's sample period: the median gap between buffered samples (0 if unknown)."""
    times = [t for t, _ in points]
    gaps = sorted(b - a for a, b in itertools.pairwise(times) if b > a)
    if gaps:
        return gaps[len(gaps) // 2]
    return 0.0


def _to_float(value: Any) -> float | None:
    """A scalar as a float (tensors via ``.item()``, off the training thread); else None.

    Anything that fails (not a number, a tensor of several elements, a CUDA error) leaves out
    this one value, with one warning, never the row.
    """
    try:
        if hasattr(value, "item"):
            value = value.item()
        number = float(value)
    except Exception as exc:
        warn_once(f"scalar:{type(value).__name__}",
                  "gpulens: a logged value of type %s could not be read as a number (%r); "
                  "left out", type(value).__name__, exc)
        return None
    return number
