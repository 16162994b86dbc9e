"""Time series and step windows.

Samples live in bounded :class:`Series` on ``time.monotonic()``.  A step's window is
``[t0, t1)``: the time between two ``log()`` calls.  Its figures are

* gauges: the time-weighted mean (trapezoid integral of the piecewise-linear series divided by
  the window length, with the series held flat beyond its first and last points), and the
  largest sample inside the window where the peak matters;
* interval measurements (GPM, whose values hold for the span between two GPM samples): the mean
  weighted by each span's overlap with the window;
* energy: NVML's energy counter, exact over long spans.  Between two counter reads the
  counter's difference is shared out in proportion to the power integral, so windows far
  shorter than the counter's ~100 ms update period still get their energy, and the windows'
  energies add up to the counter's difference.  Without a counter, the power integral.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
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

    __slots__ = ("capacity", "cols", "cums", "t")

    def __init__(self, capacity: int = 36_000) -> None:
        self.capacity = capacity
        self.t: list[float] = []
        self.cols: dict[str, list[float]] = {}
        self.cums: dict[str, list[float]] = {}

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

        ``None`` without a fresh sample: none within ``stale`` seconds of the window.
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
        for key, v in self.cols.items():
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

    def means(self, t0: float, t1: float, stale: float = 2.0) -> dict[str, float]:
        """Overlap-weighted mean of each key over ``[t0, t1]``.

        A window shorter than the spans (or between them) takes the values of the span(s) it
        overlaps or, failing that, of the nearest span.
        """
        if not self.spans:
            return {}
        acc: dict[str, float] = {}
        weight: dict[str, float] = {}
        for start, end, values in reversed(self.spans):
            if end < t0:
                break
            overlap = min(end, t1) - max(start, t0)
            if overlap <= 0:
                continue
            for key, value in values.items():
                acc[key] = acc.get(key, 0.0) + value * overlap
                weight[key] = weight.get(key, 0.0) + overlap
        if not acc:
            nearest = min(self.spans, key=lambda s: min(abs(s[0] - t1), abs(s[1] - t0)))
            if min(abs(nearest[0] - t1), abs(nearest[1] - t0)) > stale:
                return {}
            return dict(nearest[2])
        return {key: acc[key] / weight[key] for key in acc}


def window_energy_j(
    counter: Series, power: Series | None, t0: float, t1: float
) -> float | None:
    """Energy in joules over ``[t0, t1]``.

    ``counter`` holds NVML's energy counter in millijoules; ``power`` (watts) shares each
    counter difference out over time.  Where the counter does not bracket the window (or went
    backwards: a driver reset), the power integral stands in.
    """
    ts, vs = counter.t, counter.v
    if len(ts) >= 2 and ts[0] <= t0 and ts[-1] >= t1:
        k0 = bisect_right(ts, t0) - 1
        k1 = bisect_left(ts, t1)
        total = 0.0
        for k in range(k0, k1):
            a, b = ts[k], ts[k + 1]
            delta_j = (vs[k + 1] - vs[k]) / 1000.0
            lo, hi = max(a, t0), min(b, t1)
            if hi <= lo:
                continue
            if delta_j < 0:
                if power is None or not power.t:
                    return None
                total += power.integral(lo, hi)
                continue
            if lo == a and hi == b:
                total += delta_j
                continue
            share = (hi - lo) / (b - a)
            if power is not None and power.t:
                whole = power.integral(a, b)
                if whole > 0:
                    share = power.integral(lo, hi) / whole
            total += delta_j * share
        return total
    if power is not None and power.t:
        return power.integral(t0, t1)
    return None


JOB_SUFFIXES = frozenset({
    "util_pct", "sm_active_pct", "tensor_active_pct", "mem_used_gb", "mem_pct", "power_w",
    "energy_j", "temp_c", "sm_clock_mhz", "throttle_pct",
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
