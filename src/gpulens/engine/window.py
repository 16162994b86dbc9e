"""Time series and step windows.

Samples live in bounded :class:`Series` on ``time.monotonic()``.  A step's window is
``[t0, t1)``: the time between two ``log()`` calls.  Its figures are

* gauges: the time-weighted mean (trapezoid integral of the piecewise-linear series divided by
  the window length, with the series held flat beyond its first and last points), and the
  largest sample inside the window where the peak matters;
* interval measurements (GPM, whose values hold for the span between two GPM samples): the mean
  weighted by each span's overlap with the window;
* energy: the integral of the driver's 20 ms power samples, calibrated to NVML's energy
  counter (:class:`CalibratedEnergy`): exact in time like the samples, exact in total like the
  counter.

A column that stops reading (a sensor that fails mid-run) is absent from every window that
starts more than ``stale`` seconds after its last real value: never its last value carried
forward.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left, bisect_right
from collections import deque
from typing import NamedTuple


class Stat(NamedTuple):
    """One metric over one window."""

    mean: float
    max: float
    last: float
    inside: int
    """How many samples fell inside the window."""


class Table:
    """Samples of several quantities taken at the same instants (one read of a device).

    Each column keeps, beside its values, the running trapezoid integral from the first sample
    (``cum``), so the integral over any window costs two binary searches for the whole table
    and a few multiplications per column, however many samples the window holds.  Bounded to
    ``capacity`` rows.  A column missing from one read holds its previous value; a column that
    first appears late is back-filled with its first value.
    """

    __slots__ = ("capacity", "cols", "cums", "seen", "t")

    def __init__(self, capacity: int = 36_000) -> None:
        self.capacity = capacity
        self.t: list[float] = []
        self.cols: dict[str, list[float]] = {}
        self.cums: dict[str, list[float]] = {}
        self.seen: dict[str, float] = {}
        """Time of each column's last real value (held values do not count)."""

    def __len__(self) -> int:
        return len(self.t)

    def add_row(self, t: float, values: dict[str, float]) -> None:
        """Append one read; one not newer than the newest is ignored (clock went backwards)."""
        ts = self.t
        n = len(ts)
        if n and t <= ts[-1]:
            return
        for key, value in values.items():
            if key not in self.cols:
                self.cols[key] = [value] * n
                self.cums[key] = [value * (x - ts[0]) for x in ts]
        dt = t - ts[-1] if n else 0.0
        seen = self.seen
        for key in values:
            seen[key] = t
        for key, col in self.cols.items():
            got = values.get(key)
            value = col[-1] if got is None else got
            cum = self.cums[key]
            cum.append(cum[-1] + (col[-1] + value) * dt * 0.5 if n else 0.0)
            col.append(value)
        ts.append(t)
        if len(ts) > self.capacity:
            self.trim_count(len(ts) - self.capacity // 2)

    def trim_before(self, t: float) -> None:
        """Drop samples older than ``t``, keeping one before it (for interpolation)."""
        k = bisect_left(self.t, t) - 1
        if k > 256 or (k > 0 and k > len(self.t) // 2):
            self.trim_count(k)

    def trim_count(self, k: int) -> None:
        del self.t[:k]
        for col in self.cols.values():
            del col[:k]
        for cum in self.cums.values():
            del cum[:k]

    @property
    def last_time(self) -> float | None:
        return self.t[-1] if self.t else None

    def covers(self, t0: float, t1: float, slack: float) -> bool:
        """Whether samples exist within ``slack`` of both ends of ``[t0, t1]``."""
        return bool(self.t) and self.t[0] <= t0 + slack and self.t[-1] >= t1 - slack

    def _position(self, t: float) -> tuple[int, float, float]:
        """(i, f, d): ``t`` lies ``d`` seconds after sample ``i``, a fraction ``f`` of the way to
        sample ``i + 1`` (``f = 0`` beyond the ends, where the series is held flat)."""
        ts = self.t
        i = bisect_right(ts, t) - 1
        if i < 0:
            return 0, 0.0, t - ts[0]
        if i == len(ts) - 1:
            return i, 0.0, t - ts[i]
        d = t - ts[i]
        return i, d / (ts[i + 1] - ts[i]), d

    def window(
        self, t0: float, t1: float, stale: float
    ) -> tuple[dict[str, Stat], int] | None:
        """Every column's :class:`Stat` over ``[t0, t1)`` and the count of samples inside.

        ``None`` without a fresh sample: none within ``stale`` seconds of the window.  A column
        whose last real value is older than ``t0 - stale`` is left out (it stopped reading).
        """
        ts = self.t
        n = len(ts)
        if not n:
            return None
        lo = bisect_left(ts, t0)
        hi = bisect_left(ts, t1)
        inside = hi - lo
        if inside == 0 and not (
            (lo > 0 and t0 - ts[lo - 1] <= stale) or (lo < n and ts[lo] - t1 <= stale)
        ):
            return None
        i0, f0, d0 = self._position(t0)
        i1, f1, d1 = self._position(t1)
        length = t1 - t0
        out: dict[str, Stat] = {}
        fresh_after = t0 - stale
        seen = self.seen
        for key, v in self.cols.items():
            if seen.get(key, -math.inf) < fresh_after:
                continue
            c = self.cums[key]
            a0 = v[i0]
            x0 = a0 + (v[i0 + 1] - a0) * f0 if f0 else a0
            a1 = v[i1]
            x1 = a1 + (v[i1 + 1] - a1) * f1 if f1 else a1
            if length > 0:
                mean = ((c[i1] + (a1 + x1) * d1 * 0.5) - (c[i0] + (a0 + x0) * d0 * 0.5)) / length
            else:
                mean = x1
            # The peak covers the interpolated edges too, so that max >= mean always holds.
            peak = x0 if x0 > x1 else x1
            if inside:
                top = max(v[lo:hi])
                if top > peak:
                    peak = top
                out[key] = Stat(mean, peak, v[hi - 1], inside)
            else:
                out[key] = Stat(mean, peak, x1, 0)
        return out, inside


class Series(Table):
    """Timestamped samples of one quantity (a :class:`Table` of one column)."""

    __slots__ = ("c", "v")

    def __init__(self, capacity: int = 36_000) -> None:
        super().__init__(capacity)
        self.v: list[float] = []
        self.c: list[float] = []
        self.cols[""] = self.v
        self.cums[""] = self.c

    def add(self, t: float, value: float) -> None:
        """Append a sample; one older than the newest is ignored (clock went backwards)."""
        ts = self.t
        if ts:
            if t <= ts[-1]:
                return
            self.c.append(self.c[-1] + (self.v[-1] + value) * (t - ts[-1]) * 0.5)
        else:
            self.c.append(0.0)
        self.v.append(value)
        ts.append(t)
        self.seen[""] = t
        if len(ts) > self.capacity:
            self.trim_count(len(ts) - self.capacity // 2)

    def extend(self, points: list[tuple[float, float]]) -> None:
        """Append samples that are newer than the newest one held."""
        for t, value in points:
            self.add(t, value)

    def cumulative(self, t: float) -> float:
        """The integral from the first sample to ``t`` (negative before it)."""
        i, f, d = self._position(t)
        v = self.v
        x = v[i] + (v[i + 1] - v[i]) * f if f else v[i]
        return self.c[i] + (v[i] + x) * d * 0.5

    def integral(self, t0: float, t1: float) -> float:
        """Trapezoid integral over ``[t0, t1]`` (value x seconds).  Series must not be empty."""
        return self.cumulative(t1) - self.cumulative(t0)

    def stat(self, t0: float, t1: float, stale: float) -> Stat | None:
        """Mean, max, last and count over ``[t0, t1)``; ``None`` without a fresh sample.

        A sample is fresh when it lies within ``stale`` seconds of the window.
        """
        got = self.window(t0, t1, stale)
        return None if got is None else got[0][""]


class IntervalSeries:
    """Values that hold for a span ``[start, end]`` each (GPM), in time order."""

    __slots__ = ("capacity", "spans")

    def __init__(self, capacity: int = 36_000) -> None:
        self.capacity = capacity
        self.spans: list[tuple[float, float, dict[str, float]]] = []

    def add(self, start: float, end: float, values: dict[str, float]) -> None:
        if end <= start:
            return
        self.spans.append((start, end, values))
        if len(self.spans) > self.capacity:
            del self.spans[: len(self.spans) - self.capacity // 2]

    def trim_before(self, t: float) -> None:
        k = 0
        while k < len(self.spans) and self.spans[k][1] < t:
            k += 1
        if k > 64:
            del self.spans[:k]

    @property
    def last_time(self) -> float | None:
        return self.spans[-1][1] if self.spans else None

    def _weights(self, t0: float, t1: float, stale: float
                 ) -> list[tuple[float, float, dict[str, float]]]:
        """``(start, weight, values)`` of the spans a window ``[t0, t1]`` takes: each span that
        overlaps it, weighed by the overlap; failing that the nearest span (weight 1), if it
        is within ``stale`` of the window."""
        out = []
        for start, end, values in reversed(self.spans):
            if end < t0:
                break
            overlap = min(end, t1) - max(start, t0)
            if overlap > 0:
                out.append((start, overlap, values))
        if out or not self.spans:
            return out
        nearest = min(self.spans, key=lambda s: min(abs(s[0] - t1), abs(s[1] - t0)))
        if min(abs(nearest[0] - t1), abs(nearest[1] - t0)) > stale:
            return []
        return [(nearest[0], 1.0, nearest[2])]

    def means(self, t0: float, t1: float, stale: float = 2.0) -> dict[str, float]:
        """Overlap-weighted mean of each key over ``[t0, t1]``.

        A window shorter than the spans (or between them) takes the values of the span(s) it
        overlaps or, failing that, of the nearest span.
        """
        acc: dict[str, float] = {}
        weight: dict[str, float] = {}
        for _, w, values in self._weights(t0, t1, stale):
            for key, value in values.items():
                acc[key] = acc.get(key, 0.0) + value * w
                weight[key] = weight.get(key, 0.0) + w
        return {key: acc[key] / weight[key] for key in acc}

    def share_from_before(self, t0: float, t1: float, t: float, stale: float = 2.0) -> float:
        """Of the weight :meth:`means` gives the spans over ``[t0, t1]``, the share held by
        spans that began before ``t`` (0.0 where none did, or no span is taken)."""
        taken = self._weights(t0, t1, stale)
        total = sum(w for _, w, _ in taken)
        return sum(w for start, w, _ in taken if start < t) / total if total > 0 else 0.0


class CalibratedEnergy:
    """A GPU's energy per window: the power integral, calibrated to NVML's energy counter.

    The driver's power samples are 20 ms averages with exact timestamps, so their integral
    places energy in time to within a sample.  NVML's energy counter is exact in total but
    changes only every ~100 ms (``update_s``, measured at start), so a single read can be up to
    that stale: over a 1 s span that is up to ~10 % of the energy when the load jumps.  So the
    counter sets only the *scale*: ``k = (C(b) - C(a)) / integral(P, a, b)`` over the longest
    span of kept reads within the last :data:`CALIBRATION_WINDOW_S` (at least
    :data:`CALIBRATION_SPAN_S`), each read placed half an update period before it was taken,
    weighed against the power samples' own scale while the span is short (see :meth:`scale`).
    A window's energy is ``k`` times the power integral over it.  The windows then add up to
    the counter to within the staleness of two reads over the whole span, and each window keeps
    the shape of the power curve.  Without a counter, ``k = 1``.  A counter that goes
    backwards (a driver reset) starts the calibration afresh.
    """

    def __init__(self, power: Series, update_s: float = 0.1) -> None:
        self.power = power
        self.update_s = update_s
        self.reads: deque[tuple[float, float, float]] = deque()
        """Kept counter reads: (effective time, energy J, power integral up to then J)."""

    def add_counter(self, t_read: float, millijoules: float) -> bool:
        """Keep a counter read taken at ``t_read`` (the middle of the call).  True if kept."""
        if not self.power.t:
            return False  # nothing to place the energy in time with yet
        t_eff = t_read - self.update_s / 2
        joules = millijoules / 1000.0
        reads = self.reads
        if reads and joules < reads[-1][1]:
            reads.clear()  # a reset: calibrate afresh
        if reads and t_eff <= reads[-1][0]:
            return False
        reads.append((t_eff, joules, self.power.cumulative(t_eff)))
        while len(reads) > 2 and reads[-1][0] - reads[1][0] >= CALIBRATION_WINDOW_S:
            reads.popleft()
        return True

    def scale(self) -> tuple[float, float]:
        """(k, relative uncertainty of k).

        The counter's span gives ``k_span`` with uncertainty ``u_span``: each end's read may be
        ``update_s`` stale, at up to the span's peak power, so ``u_span = update_s * peak /
        integral``.  The power samples' own scale (``k = 1``) is trusted to
        :data:`NO_COUNTER_REL_ERR`.  The two are weighted by the inverse square of their
        uncertainties: a young, short span moves ``k`` little, a minute of reads sets it.
        """
        reads = self.reads
        prior = NO_COUNTER_REL_ERR
        if len(reads) < 2 or reads[-1][0] - reads[0][0] < CALIBRATION_SPAN_S:
            return 1.0, prior
        (_, e0, p0), (_, e1, p1) = reads[0], reads[-1]
        integral = p1 - p0
        if integral <= 0:
            return 1.0, prior
        k_span = (e1 - e0) / integral
        peak = max(self.power.v) if self.power.v else 0.0
        u_span = max(self.update_s * peak / integral, 1e-6)
        w_prior, w_span = 1 / prior**2, 1 / u_span**2
        k = (w_prior + w_span * k_span) / (w_prior + w_span)
        return k, (w_prior + w_span) ** -0.5

    def trim_before(self, t: float) -> None:
        """Nothing to trim: the reads are bounded by :data:`CALIBRATION_WINDOW_S`."""

    def window(self, t0: float, t1: float) -> tuple[float, float] | None:
        """(energy in J, error bound in J) of ``[t0, t1]``; ``None`` without power samples.

        The bound: the energy times the scale's relative uncertainty, plus half a power
        sample period of the power step at each edge.
        """
        power = self.power
        if not power.t:
            return None
        k, rel = self.scale()
        energy = k * power.integral(t0, t1)
        error = abs(energy) * rel + k * (_edge_error(power, t0) + _edge_error(power, t1))
        return max(0.0, energy), error


CALIBRATION_SPAN_S = 1.0
"""The shortest span of counter reads that sets the scale: shorter ones leave it at 1."""
CALIBRATION_WINDOW_S = 60.0
"""The scale comes from the counter reads of the last minute: long enough that two reads'
staleness is a fraction of a percent, short enough to follow a drift."""
NO_COUNTER_REL_ERR = 0.05
"""Relative error stated for power-integral energy that no counter span has calibrated (no
counter, or not yet): the scale of the power readings is then unchecked."""


def _edge_error(power: Series, t: float) -> float:
    """Half a sample period of the power step around ``t`` (J): how much energy the placement
    of the window's edge inside one power sample can move."""
    ts = power.t
    i = bisect_right(ts, t)
    if i <= 0 or i >= len(ts):
        return 0.0
    return abs(power.v[i] - power.v[i - 1]) * (ts[i] - ts[i - 1]) / 2


JOB_SUFFIXES = frozenset({
    "util_pct", "sm_active_pct", "tensor_active_pct", "mem_used_gb", "mem_pct", "power_w",
    "energy_j", "temp_c", "sm_clock_mhz", "throttle_pct", "nvlink_rx_gb_per_s",
    "nvlink_tx_gb_per_s", "pcie_rx_gb_per_s", "pcie_tx_gb_per_s",
})
"""The per-GPU figures that get job-level aggregates: the headline ones (every aggregate is
three more keys a row for every tracker to store)."""


def job_aggregates(per_gpu: list[dict[str, float]]) -> dict[str, float]:
    """``gpu/all/<suffix>_mean|_min|_max`` of the :data:`JOB_SUFFIXES` over the GPUs that
    report each; empty for fewer than two GPUs."""
    if len(per_gpu) < 2:
        return {}
    keys: dict[str, list[float]] = {}
    for gpu in per_gpu:
        for suffix, value in gpu.items():
            if suffix not in JOB_SUFFIXES:
                continue
            values = keys.get(suffix)
            if values is None:
                keys[suffix] = [value]
            else:
                values.append(value)
    out: dict[str, float] = {}
    for suffix, values in keys.items():
        names = _AGG_KEYS.get(suffix)
        if names is None:
            names = _AGG_KEYS[suffix] = (
                f"gpu/all/{suffix}_mean", f"gpu/all/{suffix}_min", f"gpu/all/{suffix}_max")
        out[names[0]] = sum(values) / len(values)
        out[names[1]] = min(values)
        out[names[2]] = max(values)
    return out


_AGG_KEYS: dict[str, tuple[str, str, str]] = {}


def sample_spacing(points: list[tuple[float, float]]) -> float:
    """The driver's sample period: the median gap between buffered samples (0 if unknown)."""
    times = [t for t, _ in points]
    gaps = sorted(b - a for a, b in itertools.pairwise(times) if b > a)
    if gaps:
        return gaps[len(gaps) // 2]
    return 0.0
