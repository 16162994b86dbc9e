"""The sampler thread: reads the sources on their cadences and closes step windows.

One thread per :meth:`Sampler.start` (so stop-then-start works).  It

* every ``interval`` seconds reads the cheap NVML values of each GPU and the host (psutil);
* every ``slow_interval`` seconds reads the energy counter and the driver's buffered power and
  utilization samples (the buffers hold ~2.4 s of power and ~14 s of utilization, so a read a
  second loses nothing);
* reads the buffered samples early, :data:`READY_LAG_S` after a step mark, so the row of that
  step can be finished a quarter of a second after ``log()`` rather than at the next slow read;
* every ``gpm_interval`` seconds (half the interval, at least 50 ms) polls GPM (Hopper and
  newer), whose counters refresh about every 100 ms;
* after each pass turns every step mark whose window is covered by data into a
  :class:`~gpulens.model.Row` and hands it to ``emit``.  A mark waits for its data at
  most :data:`MAX_ROW_WAIT_S` from when it reached the engine (a mark that arrives late, from
  a starved process, is not finished at once on that account); a row finished before its data
  came says so in ``perf/partial_gpus`` and with a warning.

Step marks come from the client (the training process) through :meth:`Sampler.add_mark`; the
torch allocator's figures ride on them.  NVML's calls go through ctypes, which releases the GIL
while the driver works.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpulens.engine.spec import GPM_FROM_START, GPM_START_SHARE
from gpulens.engine.window import (
    CalibratedEnergy,
    IntervalSeries,
    Series,
    Stat,
    Table,
    job_aggregates,
    sample_spacing,
)
from gpulens.errors import GpuLost
from gpulens.log import logger, warn_once
from gpulens.model import Event, GpuInfo, Mark, Row
from gpulens.schema import GPU_METRICS, Agg, gpu_key, train_key
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
from gpulens.sources.processes import GpuProcess, describe

GPM_KEYS = frozenset(GPM_IDS.values())
READY_LAG_S = 0.2
"""How long after a step mark the driver's buffers and GPM hold data covering it: buffered
power samples are ~10-25 ms old when read, GPM shows activity ~90 ms late and refreshes every
~100 ms (H200, driver 580.159; see docs/design-notes.md)."""
MIN_EARLY_READ_S = 0.2
"""Early reads of the driver's buffers (for a waiting mark) are at least this far apart."""
MAX_ROW_WAIT_S = 10.0
"""The longest a mark waits for the data covering its window before its row is finished
anyway (its missing figures then counted in ``perf/partial_gpus``)."""
MAX_MARKS = 10_000
"""Marks waiting to become rows; beyond this the oldest are dropped (counted, warned)."""
HEADLINE = ("util_pct", "power_w", "mem_used_gb", "temp_c", "sm_active_pct", "energy_j")
"""Per-GPU figures whose absence from a row, after the GPU reported them before, makes that
GPU's window partial."""

_NOT_FAST = frozenset({"util_pct", "power_w", "energy_j", "energy_err_j", "energy_short_window",
                       "torch_allocated_gb", "torch_peak_gb", "torch_alloc_retries",
                       "torch_ooms"})
# What each schema metric of the cheap reads is made of: (suffix, column of the fast table,
# take last, with max).  "util_pct" and "power_w" prefer the driver's buffered samples, energy
# and the torch allocator have their own series (see ``Sampler.gpu_window``).
_FAST_PLAN: tuple[tuple[str, str, bool, bool], ...] = tuple(
    (m.key, m.key, m.agg is Agg.LAST, m.with_max)
    for m in GPU_METRICS
    if m.key not in _NOT_FAST and m.key not in GPM_KEYS
)


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
    energy: CalibratedEnergy | None = None
    """Made at the first counter read, on the power series that has data then."""
    energy_update_s: float = 0.1
    """How often this GPU's energy counter changes (measured at start)."""
    gpm: IntervalSeries = field(default_factory=IntervalSeries)
    torch: Table = field(default_factory=Table)
    """The torch allocator's figures (GB and counts), from the client's marks."""
    limit_due: bool = True
    """Read the power limit at the next fast read (set by each slow read)."""
    periods: dict[int, float] = field(default_factory=dict)
    """The driver's sample period of each kind of buffered sample, in seconds."""
    lost: bool = False
    reported: set[str] = field(default_factory=set)
    """Headline figures this GPU has given in a row (their later absence is a hole)."""

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
        if self.energy is not None:
            self.energy.trim_before(t)
        self.gpm.trim_before(t)
        self.torch.trim_before(t)


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
        self.marks: deque[Mark] = deque()
        self._arrived: deque[float] = deque()
        """When each waiting mark reached the engine (monotonic s): a mark that comes late
        (a starved process, a full pipe) still gets its full wait for data."""
        self.dropped_marks = 0
        self.host_series: dict[str, Series] = {"cpu_pct": Series(), "ram_used_gb": Series()}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.first_read = threading.Event()
        """Set once the loop has taken its first cheap and buffered reads (:meth:`start`)."""
        self._window_start, self._prev_step = 0.0, 0
        self._first_end, self._gpm_settled = 0.0, True  # GPM spans past the first row's end?
        self._last_fast = self._last_buffers = self._last_gpm = -math.inf
        self._unix_offset = time.time() - time.monotonic()
        self._late_rows = 0
        self.failed: BaseException | None = None
        self.notes: deque[Event] = deque()
        """Notices for the next row (a GPU lost): the engine takes them into its rows."""

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, step: int = 0) -> float:
        """Take the first GPM sample here, then start the loop, which takes the rest of the
        first reading at once.  Returns the first window's start: now.  ``step``: the training
        step the first window starts after (0 for a fresh run).  The rest of the first reading
        is not waited for (on an H200 it took 0.10-0.18 s in rank 0's engine under DDP,
        `benchmarks/results/2026-11-28-h200x2-start-laps`). The first window still holds what
        the GPU did from now: the driver's buffered power and utilization samples reach back
        before the reading, the cheap figures are averaged over the readings inside the
        window, and GPM, which sees nothing before its first sample, has it from here (one
        sample a GPU: 0.03-3.7 ms).  :attr:`first_read` is set once the loop has the rest."""
        self._stop.clear()
        self._prev_step = step
        self._first_end, self._gpm_settled = 0.0, not self.gpm
        self.first_read.clear()
        now = time.monotonic()
        self._guard(self._read_gpm, now)
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

    def add_mark(self, mark: Mark) -> None:
        """Queue a step mark (the end of a window).  Beyond :data:`MAX_MARKS` waiting, the
        oldest is dropped: its steps fold into the next row's window."""
        marks = self.marks
        if len(marks) >= MAX_MARKS:
            marks.popleft()
            self._arrived.popleft()
            self.dropped_marks += 1
            warn_once("marks-full", "gpulens: %d step marks wait for their rows; the oldest "
                      "are dropped (their steps fold into the next row), counted", MAX_MARKS)
        self._arrived.append(time.monotonic())
        marks.append(mark)

    # -- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        now = time.monotonic()
        self._guard(self._read_fast, now)
        self._guard(self._read_slow, now)
        self.first_read.set()
        now = time.monotonic()
        next_fast = now + self.interval
        next_slow = now + self.slow_interval
        next_gpm = now + self.gpm_interval
        while True:
            due = min(next_fast, next_slow, next_gpm)
            early = self._early_read_due()
            if early is not None:
                due = min(due, early)
            self._wake.wait(max(0.0, due - time.monotonic()))
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
            elif early is not None and now >= early:
                self._guard(self._read_buffers, now)
            # Rows go on (host and training figures, a gap for the GPUs) whatever the reads did.
            self._guard(self._close_final if stopping else self._close_ready, now)
            if stopping:
                return

    def _early_read_due(self) -> float | None:
        """When to read the driver's buffers for the oldest waiting mark (``None``: no need)."""
        if not self.driver_samples or not self.marks or not self.gpus:
            return None
        want = self.marks[0].t + READY_LAG_S
        if self._last_buffers >= want:
            return None
        return max(want, self._last_buffers + MIN_EARLY_READ_S)

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
        self.notes.append(Event("notice", "gpu_lost", "info", -1, time.time(),
                                message=f"{exc}; its metrics stop from here (a gap)"))

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
                ("sm_clock_mhz", r.sm_clock_mhz), ("mem_clock_mhz", r.mem_clock_mhz),
            ):
                if value is not None:
                    row[key] = value
            if r.links:
                row.update(r.links)
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

    def _read_buffers(self, now: float) -> None:
        """The driver's buffered power and utilization samples of every GPU."""
        offset = self._unix_offset = time.time() - time.monotonic()
        for gpu in self.gpus:
            if gpu.lost or not self.driver_samples:
                continue
            try:
                for kind, series in ((POWER_SAMPLES, gpu.power_buf),
                                     (UTIL_SAMPLES, gpu.util_buf)):
                    points = gpu.device.read_samples(kind)
                    if not points:
                        continue
                    # A buffered sample is the average over the driver's sample period that
                    # ends at its timestamp (20 ms for power, ~200 ms for utilization on an
                    # H200): it belongs at the middle of that period.
                    period = sample_spacing(points) or gpu.periods.get(kind, 0.0)
                    gpu.periods[kind] = period
                    series.extend([(ts - offset - period / 2, v) for ts, v in points])
            except GpuLost as exc:
                self._lose(gpu, exc)
        self._last_buffers = time.monotonic()

    def _read_slow(self, now: float) -> None:
        self._read_buffers(now)
        for gpu in self.gpus:
            if gpu.lost:
                continue
            gpu.limit_due = True
            # Energy follows the finest power series there is: the driver's 20 ms samples,
            # else the cheap reads (once, it moves to the samples when they appear).
            power = gpu.power_buf if gpu.power_buf.t else gpu.power_fast
            if power.t and (gpu.energy is None or (gpu.energy.power is not power
                                                    and power is gpu.power_buf)):
                gpu.energy = CalibratedEnergy(power, gpu.energy_update_s)
            if not self.energy or gpu.energy is None:
                continue
            try:
                before = time.monotonic()
                energy = gpu.device.read_energy_mj()
                after = time.monotonic()
            except GpuLost as exc:
                self._lose(gpu, exc)
                continue
            if energy is not None:
                gpu.energy.add_counter((before + after) / 2, energy)

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
        self._last_gpm = time.monotonic()

    # -- live view ---------------------------------------------------------------------------
    def latest(self) -> dict[str, float]:
        """The newest sample of each metric, keyed like rows (a torn read at worst shows one
        sample older); a stale one (two intervals and half a second) is left out. Empty until
        the first reading is whole (:attr:`first_read`), never some GPUs' figures alone."""
        out: dict[str, float] = {}
        if not self.first_read.is_set():
            return out
        now = time.monotonic()
        stale = 2 * self.interval + 0.5
        for gpu in self.gpus:
            fast = gpu.fast
            for key, column in list(fast.cols.items()):
                if column and now - fast.seen.get(key, -math.inf) <= stale + self.slow_interval:
                    out[f"gpu/{gpu.key}/{key}"] = column[-1]
            # the newer of the cheap read and the driver's buffered samples
            for key, pair in (("util_pct", (gpu.util_fast, gpu.util_buf)),
                              ("power_w", (gpu.power_fast, gpu.power_buf))):
                fresh = max(pair, key=lambda s: s.last_time or -math.inf)
                if fresh.v and now - (fresh.last_time or -math.inf) <= stale + self.slow_interval:
                    out[f"gpu/{gpu.key}/{key}"] = fresh.v[-1]
            torch = gpu.torch
            for key, column in list(torch.cols.items()):
                if column:
                    out[f"gpu/{gpu.key}/{key}"] = column[-1]
            if gpu.gpm.spans and now - gpu.gpm.spans[-1][1] <= stale + 0.5:
                for key, value in gpu.gpm.spans[-1][2].items():
                    out[f"gpu/{gpu.key}/{key}"] = value
        for key, series in self.host_series.items():
            if series.v and now - (series.last_time or -math.inf) <= stale:
                out[f"host/{key}"] = series.v[-1]
        return out

    def processes(self) -> list[GpuProcess]:
        """The processes on the watched GPUs, by GPU then process id: NVML's running
        processes, named by psutil.  Read at the call, on the caller's thread (the engine
        process's main loop by default); a GPU that is lost or cannot list its processes gives
        none."""
        out: list[GpuProcess] = []
        for gpu in self.gpus:
            if gpu.lost:
                continue
            try:
                listed = gpu.device.read_processes()
            except GpuLost:
                continue
            out.extend(describe(gpu.key, pid, used) for pid, used in listed)
        return out

    # -- windows -----------------------------------------------------------------------------
    def _ready(self, mark: Mark, arrived: float, now: float) -> bool:
        """Whether the data covering the mark's window has been read (or the mark waited
        long enough here: then its row is finished with what there is)."""
        if now - arrived > MAX_ROW_WAIT_S:
            return True
        if self._last_fast < mark.t:
            return False
        if not self.gpus:
            return True
        want = mark.t + READY_LAG_S
        if self.driver_samples and self._last_buffers < want:
            return False
        return not (self.gpm and self._last_gpm < want)

    def _close_windows(self, final: bool) -> None:
        now = time.monotonic()
        while self.marks:
            mark = self.marks[0]
            if not final and not self._ready(mark, self._arrived[0], now):
                break
            self.marks.popleft()
            self._arrived.popleft()
            row = self._row(mark)
            try:
                self.emit(row)
            except Exception as exc:  # a sink problem is the step logger's to count
                warn_once("emit", "gpulens: could not hand a row on: %r", exc)
            # Finishing a row is pure Python under the GIL: yield it after each row, so that
            # a thread that waits for the GIL waits for one row, not a burst.
            time.sleep(0)
        horizon = self.marks[0].t if self.marks else self._window_start
        horizon -= 2 * self.slow_interval + MAX_ROW_WAIT_S
        for gpu in self.gpus:
            gpu.trim_before(horizon)
        for s in self.host_series.values():
            s.trim_before(horizon)

    def gpu_window(self, gpu: GpuState, t0: float, t1: float) -> dict[str, float]:
        """The figures of one GPU over ``[t0, t1)``, keyed by schema suffix."""
        stale = 2 * self.interval + 0.5
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
        # utilization and power: the driver's buffered samples wherever they have data near
        # the window (the cheap reads stop once they come), else the cheap reads
        util = _stat(gpu.util_buf, t0, t1, stale) or _stat(gpu.util_fast, t0, t1, stale)
        if util is not None:
            out["util_pct"] = util.mean
        power = _stat(gpu.power_buf, t0, t1, stale) or _stat(gpu.power_fast, t0, t1, stale)
        if power is not None:
            out["power_w"] = power.mean
            out["power_w_max"] = power.max
            energy = gpu.energy.window(t0, t1) if gpu.energy is not None else None
            if energy is not None:
                out["energy_j"], out["energy_err_j"] = energy
                if t1 - t0 < gpu.energy_update_s:
                    out["energy_short_window"] = 1.0
        out.update(gpu.gpm.means(t0, t1, stale))
        torch = gpu.torch.window(t1, t1, self.slow_interval + stale)
        if torch is not None:
            for key, st in torch[0].items():
                out[key] = st.last
        out["samples"] = float(count)
        return out

    def _row(self, mark: Mark) -> Row:
        t0, t1 = self._window_start, mark.t
        if mark.alloc:
            for gpu in self.gpus:
                mem = mark.alloc.get(gpu.torch_index) if gpu.torch_index is not None else None
                if mem is not None:
                    allocated, peak, retries, ooms = mem
                    gpu.torch.add_row(t1, {"torch_allocated_gb": allocated,
                                           "torch_peak_gb": peak,
                                           "torch_alloc_retries": retries,
                                           "torch_ooms": ooms})
        self._window_start = t1
        steps = max(1, mark.step - self._prev_step)
        self._prev_step = mark.step
        values: dict[str, float] = {}
        energy_total = 0.0
        have_energy = False
        partial = 0
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
            if not gpu.lost:
                missing = [k for k in gpu.reported if k not in figures]
                if missing:
                    partial += 1
                    warn_once(f"partial:{gpu.key}:{','.join(sorted(missing))}",
                              "gpulens: GPU %d's row at step %d lacks %s, which it reported "
                              "before (the data did not come in time, or the read fails); "
                              "counted in perf/partial_gpus", gpu.key, mark.step,
                              ", ".join(sorted(missing)))
                gpu.reported.update(k for k in HEADLINE if k in figures)
        values.update(job_aggregates(per_gpu))
        stale = 2 * self.interval + 0.5
        for key, series in self.host_series.items():
            st = series.stat(t0, t1, stale)
            if st is not None:
                values[f"host/{key}"] = st.mean
        values["perf/steps"] = float(steps)
        values["perf/step_time_s"] = (t1 - t0) / steps
        if self.gpus:
            values["perf/partial_gpus"] = float(partial)
        if have_energy:
            values["perf/energy_per_step_j"] = energy_total / steps
        for name, value in mark.scalars.items():
            values[train_key(name)] = value
        values["train/global_step"] = float(mark.step)
        if not self._gpm_settled:  # do its GPM spans reach back into the start?
            first = self._first_end = self._first_end or t1
            share = max((g.gpm.share_from_before(t0, t1, first, stale) for g in self.gpus),
                        default=0.0)
            if share > GPM_START_SHARE:
                values[GPM_FROM_START] = share
            self._gpm_settled = share == 0.0
        return Row(step=mark.step, time=mark.wall, values=values)


def _stat(series: Series, t0: float, t1: float, stale: float) -> Stat | None:
    return series.stat(t0, t1, stale) if series.t else None
