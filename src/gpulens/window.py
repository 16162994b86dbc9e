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
from dataclasses import dataclass


@dataclass(frozen=True)
class Stat:
    """One metric over one window."""

    mean: float
    max: float
    last: float
    inside: int
    """How many samples fell inside the window."""


class Series:
    """Timestamped samples of one quantity, in time order, bounded to ``capacity`` points."""

    __slots__ = ("capacity", "t", "v")

    def __init__(self, capacity: int = 36_000) -> None:
        self.capacity = capacity
        self.t: list[float] = []
        self.v: list[float] = []

    def __len__(self) -> int:
        return len(self.t)

    def add(self, t: float, value: float) -> None:
        """Append a sample; one older than the newest is ignored (clock went backwards)."""
        if self.t and t <= self.t[-1]:
            return
        self.t.append(t)
        self.v.append(value)
        if len(self.t) > self.capacity:
            self.trim_count(len(self.t) - self.capacity // 2)

    def extend(self, points: list[tuple[float, float]]) -> None:
        """Append samples that are newer than the newest one held."""
        for t, value in points:
            self.add(t, value)

    def trim_before(self, t: float) -> None:
        """Drop samples older than ``t``, keeping one before it (for interpolation)."""
        k = bisect_left(self.t, t) - 1
        if k > 256 or (k > 0 and k > len(self.t) // 2):
            self.trim_count(k)

    def trim_count(self, k: int) -> None:
        del self.t[:k]
        del self.v[:k]

    @property
    def last_time(self) -> float | None:
        return self.t[-1] if self.t else None

    def covers(self, t0: float, t1: float, slack: float) -> bool:
        """Whether samples exist within ``slack`` of both ends of ``[t0, t1]``."""
        return bool(self.t) and self.t[0] <= t0 + slack and self.t[-1] >= t1 - slack

    def value_at(self, t: float) -> float:
        """Linear interpolation, flat beyond the ends.  The series must not be empty."""
        ts, vs = self.t, self.v
        i = bisect_right(ts, t)
        if i == 0:
            return vs[0]
        if i == len(ts):
            return vs[-1]
        ta, tb = ts[i - 1], ts[i]
        va, vb = vs[i - 1], vs[i]
        return va + (vb - va) * (t - ta) / (tb - ta)

    def integral(self, t0: float, t1: float) -> float:
        """Trapezoid integral over ``[t0, t1]`` (value x seconds).  Series must not be empty."""
        ts, vs = self.t, self.v
        i = bisect_right(ts, t0)
        prev_t, prev_v = t0, self.value_at(t0)
        acc = 0.0
        n = len(ts)
        while i < n and ts[i] < t1:
            acc += (prev_v + vs[i]) * (ts[i] - prev_t)
            prev_t, prev_v = ts[i], vs[i]
            i += 1
        acc += (prev_v + self.value_at(t1)) * (t1 - prev_t)
        return acc / 2

    def stat(self, t0: float, t1: float, stale: float) -> Stat | None:
        """Mean, max, last and count over ``[t0, t1)``; ``None`` without a fresh sample.

        A sample is fresh when it lies within ``stale`` seconds of the window.
        """
        ts = self.t
        if not ts:
            return None
        lo = bisect_left(ts, t0)
        hi = bisect_left(ts, t1)
        inside = hi - lo
        if inside == 0:
            before_ok = lo > 0 and t0 - ts[lo - 1] <= stale
            after_ok = lo < len(ts) and ts[lo] - t1 <= stale
            if not (before_ok or after_ok):
                return None
        length = t1 - t0
        if length <= 0:
            v = self.value_at(t1)
            return Stat(v, v, v, inside)
        mean = self.integral(t0, t1) / length
        # The peak covers the interpolated edges too, so that max >= mean always holds.
        edge_peak = max(self.value_at(t0), self.value_at(t1))
        if inside:
            peak = max(edge_peak, max(self.v[lo:hi]))
            last = self.v[hi - 1]
        else:
            peak = edge_peak
            last = self.value_at(t1)
        return Stat(mean, peak, last, inside)


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


def job_aggregates(per_gpu: list[dict[str, float]]) -> dict[str, float]:
    """``gpu/all/<suffix>_mean|_min|_max`` over the GPUs that report each suffix.

    Empty for fewer than two GPUs.  ``samples`` is left out (it is a count, not a metric).
    """
    if len(per_gpu) < 2:
        return {}
    keys: dict[str, list[float]] = {}
    for gpu in per_gpu:
        for suffix, value in gpu.items():
            if suffix != "samples":
                keys.setdefault(suffix, []).append(value)
    out: dict[str, float] = {}
    for suffix, values in keys.items():
        out[f"gpu/all/{suffix}_mean"] = sum(values) / len(values)
        out[f"gpu/all/{suffix}_min"] = min(values)
        out[f"gpu/all/{suffix}_max"] = max(values)
    return out
