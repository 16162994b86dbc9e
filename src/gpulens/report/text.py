"""Small text helpers shared by the report, ``record`` and ``watch``: sparklines, durations,
and the plain-text and Markdown summary tables."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from gpulens.report.load import Record
from gpulens.report.summary import GpuSummary, RunSummary, Throughput

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 32, lo: float | None = None,
              hi: float | None = None) -> str:
    """Unicode block sparkline of the last ``width`` buckets of ``values`` (mean per bucket)."""
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return ""
    if len(vals) > width:
        size = len(vals) / width
        vals = [
            sum(chunk) / len(chunk)
            for b in range(width)
            if (chunk := vals[int(b * size) : int((b + 1) * size)])
        ]
    a = min(vals) if lo is None else lo
    b = max(vals) if hi is None else hi
    if b <= a:
        return BARS[0] * len(vals)
    n = len(BARS) - 1
    return "".join(BARS[max(0, min(n, round((v - a) / (b - a) * n)))] for v in vals)


def figure(v: float) -> str:
    """A rate for people: ``"26,000"`` above 1000, else 4 significant digits (``"22.84"``)."""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def sized(v: float) -> str:
    """A figure with three significant digits and no more decimals than that needs:
    ``"989"``, ``"60.6"``, ``"2.43"``, ``"0.0339"``, so that a small MFU or TFLOP/s reads as
    what it is, never ``"0.0"``."""
    a = abs(v)
    if a >= 100 or not math.isfinite(v):
        return f"{v:.0f}"
    if a == 0:
        return "0"
    return f"{v:.{2 - math.floor(math.log10(a))}f}"


def duration(seconds: float | None) -> str:
    """``"2 h 05 min"``, ``"3 min 12 s"``, ``"4.2 s"``."""
    if seconds is None:
        return "n/a"
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    if m < 60:
        return f"{m} min {s:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def num(v: float | None, unit: str = "", digits: int = 1) -> str:
    """``v`` with ``digits`` decimals and a unit, or ``"n/a"``."""
    if v is None:
        return "n/a"
    return f"{v:.{digits}f}{(' ' + unit) if unit and unit != '%' else unit}"


def activity_text(g: GpuSummary) -> str:
    """``"91.2% / 99.0% SM active"``."""
    if g.activity_metric is None:
        return "n/a"
    label = "SM active" if g.activity_metric == "sm_active_pct" else "util"
    return f"{num(g.activity_mean_pct, '%')} / {num(g.activity_max_pct, '%')} {label}"


GIB_PER_GB = 1e9 / 2**30
"""gpulens counts memory in GB of 1e9 bytes (NVML's bytes / 1e9); a GiB is 2**30 bytes."""


def gib(gb: float) -> float:
    """GB (1e9 bytes) to GiB (2**30 bytes): an "80GB" card's 85.9 GB are 80.0 GiB."""
    return gb * GIB_PER_GB


def memory_text(g: GpuSummary) -> str:
    """``"64.80 / 85.9 GB (80.0 GiB)"``: peak used / total, GB of 1e9 bytes."""
    if g.mem_peak_gb is None:
        return "n/a"
    total = f" / {g.mem_total_gb:.1f}" if g.mem_total_gb else ""
    in_gib = f" ({gib(g.mem_total_gb):.1f} GiB)" if g.mem_total_gb else ""
    return f"{g.mem_peak_gb:.2f}{total} GB{in_gib}"


def power_text(g: GpuSummary) -> str:
    if g.power_mean_w is None:
        return "n/a"
    limit = f" (limit {g.power_limit_w:.0f})" if g.power_limit_w else ""
    return f"{g.power_mean_w:.0f} / {num(g.power_max_w, digits=0)} W{limit}"


def throttle_text(g: GpuSummary) -> str:
    if g.throttle_pct is None:
        return "n/a"
    return f"{g.throttle_pct:.1f}% ({g.throttle_reasons()})"


def energy_text(wh: float | None) -> str:
    if wh is None:
        return "n/a"
    return f"{wh:.3f} Wh" if wh < 10 else f"{wh:.1f} Wh"


def gpu_label(g: GpuSummary) -> str:
    return f"{g.gpu} · {g.name}" if g.name else g.gpu


HEADERS = ("GPU", "Activity mean / max", "Tensor active", "Peak memory", "Power mean / max",
           "Max temp", "Energy", "Throttled (why)")


def gpu_cells(g: GpuSummary) -> tuple[str, ...]:
    """One table row per GPU, same order as :data:`HEADERS`."""
    return (
        gpu_label(g),
        activity_text(g),
        num(g.tensor_active_mean_pct, "%"),
        memory_text(g),
        power_text(g),
        num(g.temp_max_c, "°C", 0),
        energy_text(g.energy_wh),
        throttle_text(g),
    )


def peak_text(meta: Mapping[str, str | float]) -> str | None:
    """MFU's denominator in words, from a run's metadata: ``"989.4 TFLOP/s, the dense bf16
    peak of one H100 SXM5 80GB"``; ``None`` where the run recorded no peak."""
    tflops = meta.get("peak_tflops")
    if not isinstance(tflops, int | float):
        return None
    dtype = meta.get("peak_dtype") or meta.get("dtype")
    gpu = meta.get("peak_gpu")
    return (f"{tflops:g} TFLOP/s, the dense {dtype or '(dtype not recorded)'} peak of one "
            f"{gpu or 'GPU (model not recorded)'}")


def flops_text(meta: Mapping[str, str | float]) -> str | None:
    """How the run counted model FLOPs: ``"7.44e+08 FLOPs per token (formula)"``."""
    parts = []
    for key, what in (("flops_per_token", "per token"), ("flops_per_sample", "per sample")):
        v = meta.get(key)
        if isinstance(v, int | float):
            parts.append(f"{v:.3g} FLOPs {what}")
    method = meta.get("flops_method")
    if not parts and not method:
        return None
    text = ", ".join(parts) if parts else "model FLOPs"
    return text + (f" ({method})" if method else "")


def mfu_notes(record: Record, t: Throughput) -> list[tuple[str, str]]:
    """``(run label, sentence)``: what MFU was divided by and how model FLOPs were counted
    (from the record's header), or why there is no MFU; one per run where the chosen runs'
    metadata differ (label ``""`` otherwise)."""
    metas = [(info.label, info.meta) for info in record.selected]
    distinct = {tuple(sorted(m.items())) for _, m in metas if m}
    out = []
    for label, meta in metas if len(distinct) > 1 else [("", record.meta)]:
        peak = peak_text(meta)
        if t.mfu_pct is None and not peak:
            out.append((label, _why_no_mfu(record, meta)))
            continue
        if peak is None:
            text = ("MFU = achieved model TFLOP/s per GPU / the GPU's dense peak in the run's "
                    "dtype; this record's header does not say which peak (written before "
                    "gpulens recorded it).")
        else:
            text = f"MFU = achieved model TFLOP/s per GPU / {peak}"
            dtype = meta.get("dtype")
            if dtype and dtype != meta.get("peak_dtype"):
                text += f" (the run's dtype: {dtype})"
            text += "."
            source = meta.get("peak_source")
            if source:
                text += f" Peak from: {source}."
        flops = flops_text(meta)
        text += (f" Model FLOPs: {flops}" if flops else " Model FLOPs as the run logged them")
        text += ("; model FLOPs, not hardware FLOPs: recomputed activations are not counted as "
                 "work. The clock-adjusted MFU scales the peak by the mean SM clock over the "
                 "boost clock the peak assumes.")
        out.append((label, text))
    return out


def _why_no_mfu(record: Record, meta: Mapping[str, str | float]) -> str:
    """Why rows with throughput have no MFU, in one sentence."""
    if not any("perf/tflops" in r.values for r in record.rows):
        return ("No MFU: the rows have no model FLOPs (give Monitor(flops_per_token=...) or "
                "log(step, flops=...)).")
    if "dtype" not in meta and "peak_dtype" not in meta:
        return ("No MFU: the run's compute dtype was not given (Monitor(dtype=\"bf16\")), so "
                "there is no peak to divide by.")
    return (f"No MFU: gpulens has no {meta.get('dtype', '')} peak for this GPU, and never "
            "borrows another card's (the run's log names the GPU).")


def throughput_pieces(t: Throughput, rate: bool = True) -> list[str]:
    """``"throughput: 163,029 tokens/s"``, ``"achieved: 60.6 TFLOP/s per GPU"``,
    ``"MFU: 6.1% (clock-adjusted 6.4%)"``; ``rate=False`` leaves the throughput out."""
    out = []
    if rate and t.per_s is not None:
        out.append(f"throughput: {figure(t.per_s)} {t.unit}/s")
    if t.tflops is not None:
        out.append(f"achieved: {sized(t.tflops)} TFLOP/s per GPU")
    if t.mfu_pct is not None:
        clock = (f" (clock-adjusted {sized(t.mfu_clock_adjusted_pct)}%)"
                 if t.mfu_clock_adjusted_pct is not None else "")
        out.append(f"MFU: {sized(t.mfu_pct)}%{clock}")
    return out


def of_gpus(s: RunSummary, n: int) -> str:
    """`` (1 of 2 GPUs)`` where a run-level sum covers fewer GPUs than the run has."""
    return f" ({n} of {len(s.gpus)} GPUs)" if 0 < n < len(s.gpus) else ""


def headline(s: RunSummary) -> list[str]:
    """Run-level facts as ``"label: value"`` pieces."""
    out = []
    if s.steps is not None and s.first_step is not None:
        out.append(f"steps: {s.steps} ({s.first_step} to {s.last_step})")
    out.append(f"duration: {duration(s.duration_s)}")
    out.append(f"GPUs: {len(s.gpus)}" + (" SIMULATED" if s.backend == "simulated" else ""))
    if s.energy_wh is not None:
        out.append(f"energy: {energy_text(s.energy_wh)}{of_gpus(s, s.energy_gpus)}")
    if s.power_mean_w is not None:
        out.append(f"mean power: {s.power_mean_w:.0f} W{of_gpus(s, s.power_gpus)}")
    if s.energy_per_step_j is not None:
        out.append(f"energy/step: {s.energy_per_step_j:.1f} J")
    if s.loss_first is not None and s.loss_last is not None:
        out.append(f"loss: {s.loss_first:.4g} → {s.loss_last:.4g} (min {s.loss_min:.4g})")
    for key, (rows, first) in s.not_finite.items():
        out.append(f"{key.removeprefix('train/')}: NOT FINITE (NaN or inf) in {rows} row(s), "
                   f"first at step {first}")
    if s.step_time_mean_s is not None:
        out.append(f"mean step time: {s.step_time_mean_s * 1000:.0f} ms")
    e = s.efficiency
    given = e is not None and e.source == "given"
    if s.throughput is not None:  # the engine's figures; a throughput handed in wins
        out.extend(throughput_pieces(s.throughput, rate=not given))
    if e is not None:
        if given:
            out.append(f"work: {e.work:g} {e.unit}")
        if e.per_joule is not None:
            out.append(f"efficiency: {figure(e.per_joule)} {e.unit}/J")
        if given and e.per_second is not None:
            out.append(f"throughput: {figure(e.per_second)} {e.unit}/s")
    return out


def render_text(s: RunSummary, title: str = "gpulens summary") -> str:
    """Plain-text summary for a terminal: headline, then an aligned table per GPU."""
    rows = [HEADERS, *(gpu_cells(g) for g in s.gpus)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADERS))]
    lines = [title, "  " + " · ".join(headline(s))]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if not s.gpus:
        lines.append("  (no GPU metrics in the rows)")
    return "\n".join(lines) + "\n"


def _md(cell: str) -> str:
    return cell.replace("|", "\\|")


def render_markdown_summary(s: RunSummary, title: str = "gpulens summary") -> str:
    """Markdown: a heading, the headline, the per-GPU table."""
    lines = [f"### {title}", "", " · ".join(f"**{h}**" if i == 0 else h
                                           for i, h in enumerate(headline(s))), ""]
    if s.gpus:
        lines.append("| " + " | ".join(HEADERS) + " |")
        lines.append("|" + "---|" * len(HEADERS))
        for g in s.gpus:
            lines.append("| " + " | ".join(_md(c) for c in gpu_cells(g)) + " |")
    else:
        lines.append("_No GPU metrics in the rows._")
    return "\n".join(lines) + "\n"
