"""Line charts as inline SVG: no JavaScript library, no network.

Each chart is an ``<svg class="chart">`` whose ``data-points`` attribute counts the points drawn
(the tests assert on it), with ``data-x0/x1/y0/y1`` giving the data range of the plot area so
the page's small hover script can turn pixels back into values.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 560, 224
LEFT, RIGHT, TOP, BOTTOM = 66, 14, 12, 44
PALETTE = (
    "#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#db2777", "#0891b2", "#65a30d",
)
MAX_POINTS = 800
"""Series longer than this are reduced to the min and max of each bucket (peaks survive)."""


@dataclass
class Series:
    """One line: ``points`` are (x, y) in data units, sorted by x."""

    label: str
    points: list[tuple[float, float]]
    color: str
    dash: str | None = None
    width: float = 1.8
    legend: bool = True
    hover: bool = True
    """False for a reference line (a limit, a target): the hover read-out leaves it out."""


def color(i: int) -> str:
    """The palette colour for series ``i``."""
    return PALETTE[i % len(PALETTE)]


def downsample(
    points: list[tuple[float, float]], limit: int = MAX_POINTS
) -> list[tuple[float, float]]:
    """Keep at most about ``limit`` points: the min and max of each of ``limit/2`` buckets."""
    if len(points) <= limit:
        return points
    buckets = limit // 2
    size = len(points) / buckets
    out: list[tuple[float, float]] = []
    for b in range(buckets):
        chunk = points[int(b * size) : int((b + 1) * size)]
        if not chunk:
            continue
        lo = min(chunk, key=lambda p: p[1])
        hi = max(chunk, key=lambda p: p[1])
        out.extend(sorted({lo, hi}))
    return out


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values covering [lo, hi], about ``n`` of them."""
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) * 0.1 or 1.0)
    raw = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks: list[float] = []
    v = start
    while v < hi + step * 0.999 and len(ticks) < 20:
        ticks.append(round(v, 12))
        v += step
    return ticks


def tick_labels(ticks: list[float]) -> list[str]:
    """Labels for evenly spaced ticks, each exact and no two alike: as many decimals as the
    spacing needs (``4.705, 4.71, 4.715`` reads ``4.705, 4.710, 4.715``), ``k``/``M`` for large
    values, powers of ten for small ones (``2e-05``)."""
    if not ticks:
        return []
    top = max(abs(t) for t in ticks)
    step = min((abs(b - a) for a, b in itertools.pairwise(ticks) if b != a),
               default=top or 1.0)
    if 0 < top < 0.01:
        for p in range(7):
            labels = [f"{t:.{p}e}" if t else "0" for t in ticks]
            if all(_close(float(x), t, step) for x, t in zip(labels, ticks, strict=True)):
                return labels
        return [f"{t:.6e}" for t in ticks]
    scale, suffix = (1e6, "M") if top >= 1e6 else (1e3, "k") if top >= 1e4 else (1.0, "")
    for d in range(13):
        labels = [f"{t / scale:.{d}f}" for t in ticks]
        if all(_close(float(x) * scale, t, step) for x, t in zip(labels, ticks, strict=True)):
            return [("0" if float(x) == 0 else x + suffix) for x in labels]
    return [fmt(t) for t in ticks]


def _close(shown: float, value: float, step: float) -> bool:
    return abs(shown - value) <= step * 1e-6


def fmt(v: float) -> str:
    """Short number text for axes and tables: ``1.2k``, ``0.35``, ``3e-04``."""
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 0.01:
        return f"{v:.3g}"
    return f"{v:.2g}"


def line_chart(
    chart_id: str,
    title: str,
    unit: str,
    series: list[Series],
    x_range: tuple[float, float],
    y_floor: float | None = 0.0,
    y_ceiling: float | None = None,
    x_label: str = "step",
    y_label: str = "",
    x_ticks: list[tuple[float, str]] | None = None,
    x_log2: bool = False,
) -> str:
    """A ``<figure>`` with a title, a legend and the SVG chart; empty series are left out.

    ``y_floor``/``y_ceiling`` pin the y-axis ends (0 for most gauges, 100 for percentages);
    ``None`` lets the data decide.  ``x_label`` names the x-axis (``"step"``, or
    ``"elapsed s"`` for wall-clock rows), ``y_label`` the y-axis (its unit).  ``x_ticks``
    places the x ticks and their labels instead of round numbers (e.g. batch sizes on a log
    axis); ``x_log2`` says the x values are ``log2`` of what they stand for, so the hover
    read-out shows ``2**x``.
    """
    series = [s for s in series if s.points]
    pts = [p for s in series for p in s.points]
    x0, x1 = x_range
    if x1 <= x0:
        x1 = x0 + 1
    ys = [p[1] for p in pts] or [0.0]
    y0 = min(ys) if y_floor is None else min(y_floor, min(ys))
    y1 = max(ys) if y_ceiling is None else max(y_ceiling, max(ys))
    if y1 <= y0:
        pad = abs(y1) * 0.1 or 1.0
        y0, y1 = y0 - (pad if y_floor is None else 0), y1 + pad
    yt = nice_ticks(y0, y1)
    y0, y1 = min(y0, yt[0]), max(y1, yt[-1])
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return TOP + (1 - (y - y0) / (y1 - y0)) * ph

    parts: list[str] = []
    for t, label in zip(yt, tick_labels(yt), strict=True):
        y = sy(t)
        parts.append(
            f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="tick ytick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{label}</text>"
        )
    if x_ticks is None:
        xt = [t for t in nice_ticks(x0, x1, 6) if x0 <= t <= x1]
        x_ticks = list(zip(xt, tick_labels(xt), strict=True))
    for t, label in x_ticks:
        x = sx(t)
        parts.append(
            f'<line class="xtick" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP + ph}" y2="{TOP + ph + 4}"/>'
            f'<text class="tick xtick-label" x="{x:.1f}" y="{TOP + ph + 17}" '
            f'text-anchor="middle">{label}</text>'
        )
    parts.append(
        f'<line class="axis" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{TOP + ph}" y2="{TOP + ph}"/>'
        f'<text class="axis-label x-label" x="{LEFT + pw / 2:.1f}" y="{HEIGHT - 6}" '
        f'text-anchor="middle">{escape(x_label)}</text>'
    )
    if y_label:
        parts.append(
            f'<text class="axis-label y-label" x="0" y="0" text-anchor="middle" '
            f'transform="translate(13 {TOP + ph / 2:.1f}) rotate(-90)">{escape(y_label)}</text>'
        )
    drawn = 0
    for s in series:
        reduced = downsample(s.points)
        drawn += len(reduced)
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in reduced)
        dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
        if len(reduced) == 1:
            cx, cy = sx(reduced[0][0]), sy(reduced[0][1])
            parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="{s.color}"/>')
        hover = "" if s.hover else ' data-hover="off"'
        parts.append(
            f'<polyline data-label="{escape(s.label)}"{hover} fill="none" stroke="{s.color}" '
            f'stroke-width="{s.width}"{dash} points="{coords}"/>'
        )
    if not series:
        parts.append(
            f'<text class="empty" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">'
            "no data</text>"
        )
    legend = "".join(
        f'<span class="key"><i style="background:{s.color}"'
        f'{" class=dashed" if s.dash else ""}></i>{escape(s.label)}</span>'
        for s in series
        if s.legend
    )
    return (
        f'<figure class="card" id="{escape(chart_id)}">'
        f'<figcaption><b>{escape(title)}</b> <span class="unit">{escape(unit)}</span>'
        f'<span class="legend">{legend}</span></figcaption>'
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" data-points="{drawn}" '
        f'data-x0="{x0!r}" data-x1="{x1!r}" data-y0="{y0!r}" data-y1="{y1!r}" '
        f'data-left="{LEFT}" data-right="{WIDTH - RIGHT}" data-top="{TOP}" '
        f'data-bottom="{TOP + ph}" data-xlabel="{escape(x_label)}" '
        + ('data-xscale="log2" ' if x_log2 else "")
        + 'role="img" '
        f'aria-label="{escape(title)}">'
        + "".join(parts)
        + f'<line class="cursor" x1="0" x2="0" y1="{TOP}" y2="{TOP + ph}" visibility="hidden"/>'
        "</svg></figure>"
    )
