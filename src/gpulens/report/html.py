"""One self-contained HTML page: inline CSS, inline SVG charts, a few lines of inline script
for hover read-outs.  Nothing is fetched at view time.

Layout: the GPU models and the backend under the title (a SIMULATED GPUs banner when a
simulator made the figures); training charts (loss, learning rate, gradient norm, step time) in
the left column, beside the GPU charts (activity, memory, power, temperature, clocks held down)
in the right, all on the same x-axis with one line per GPU: the step, or elapsed seconds for a
wall-clock record (``gpulens record``: ``record/elapsed_s``, else time since the run's start).
Every axis is labelled and its tick labels are exact.  Where the rows carry the engine's work
figures, a throughput and MFU section follows on the same step axis: tokens/s (or samples/s),
achieved TFLOP/s per GPU, MFU and the clock-adjusted MFU beside GPM tensor-core activity, and
the MFU the tensor cores gave while busy; its table states MFU's denominator (the peak GPU,
dtype, TFLOP/s and the document they come from, from the record's header) and how model FLOPs
were counted, or why there is no MFU.  Then the per-GPU table, energy and the one efficiency
figure (work per joule: the engine's tokens per joule where the rows have it, else the
``--work`` handed in), the alerts and notices the engine wrote (what it saw and what to try),
and the runs of the file when it holds several.  One column below 900 px; no sideways scroll
at 700 px.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from html import escape

from gpulens.report.load import Record
from gpulens.report.summary import RunSummary, Throughput
from gpulens.report.svg import Series, color, line_chart
from gpulens.report.text import (
    HEADERS,
    duration,
    energy_text,
    figure,
    gpu_cells,
    mfu_notes,
    of_gpus,
    sized,
    sparkline,
)

_GPU_KEY = re.compile(r"^gpu/(\d+)/")

CSS = """
:root{--fg:#0f172a;--muted:#64748b;--line:#e2e8f0;--bg:#f8fafc;--card:#fff}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;
 color:var(--fg);background:var(--bg)}
main{max-width:1240px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 10px}
.sub{color:var(--muted);margin-bottom:16px}
.kpis{display:grid;grid-template-columns:repeat(auto-fit,minmax(150px,1fr));gap:10px}
.kpi{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:10px 14px}
.kpi .v{font-size:20px;font-weight:600} .kpi .l{color:var(--muted);font-size:12px}
.cols{display:grid;grid-template-columns:1fr 1fr;gap:14px;align-items:start}
.cols.single{grid-template-columns:1fr}
.col{display:grid;gap:14px} .colhead{color:var(--muted);font-weight:600;font-size:12px;
 text-transform:uppercase;letter-spacing:.06em}
.grid2{display:grid;grid-template-columns:1fr 1fr;gap:14px}
.card{background:var(--card);border:1px solid var(--line);border-radius:10px;margin:0;
 padding:10px 12px 4px}
figcaption{display:flex;flex-wrap:wrap;gap:6px 10px;align-items:baseline}
.unit{color:var(--muted);font-size:12px}
.legend{margin-left:auto;display:flex;flex-wrap:wrap;gap:4px 10px;font-size:12px;color:#334155}
.key i{display:inline-block;width:14px;height:3px;margin-right:4px;vertical-align:middle}
.key i.dashed{background-image:linear-gradient(90deg,transparent 50%,#fff 50%)!important;
 background-size:6px 3px}
svg.chart{width:100%;height:auto;display:block}
.grid{stroke:var(--line)} .axis{stroke:#94a3b8} .xtick{stroke:#94a3b8}
.tick{fill:var(--muted);font-size:11px} .empty{fill:var(--muted)}
.cursor{stroke:#475569;stroke-dasharray:3 3}
table{border-collapse:collapse;width:100%;background:var(--card);border:1px solid var(--line);
 border-radius:10px;overflow:hidden}
th,td{padding:7px 10px;border-bottom:1px solid var(--line);text-align:left;font-size:13px}
th{background:#f1f5f9;font-size:12px;color:#334155}
td.spark{font-family:monospace;color:#2563eb;white-space:nowrap;letter-spacing:-1px}
#tip{position:absolute;pointer-events:none;background:#0f172a;color:#fff;font-size:12px;
 padding:6px 8px;border-radius:6px;white-space:pre;z-index:9}
#js-errors{color:#b91c1c;white-space:pre}
.note{color:var(--muted);font-size:12px;margin-top:10px}
.axis-label{fill:#334155;font-size:12px}
.banner{background:#fef3c7;border:1px solid #f59e0b;color:#78350f;border-radius:10px;
 padding:8px 12px;margin:8px 0 10px}
.scroll{overflow-x:auto;max-width:100%}
table.narrow{width:auto;max-width:100%}
tr.chosen td{font-weight:600}
tr.critical td{color:#b91c1c}
code{font-size:12px;background:#f1f5f9;padding:0 3px;border-radius:4px}
.sub{overflow-wrap:anywhere}
@media (max-width:900px){.cols,.grid2{grid-template-columns:1fr}}
@media (max-width:760px){main{padding:12px}th,td{padding:5px 6px;font-size:12px}
 #summary td.spark,#summary th:last-child{display:none}}
"""

SCRIPT = """
window.onerror=function(msg,src,line){var e=document.getElementById('js-errors');
 e.hidden=false;e.textContent+=msg+' (line '+line+')\\n';};
(function(){
var tip=document.getElementById('tip');
function fmt(v){var a=Math.abs(v);if(a===0)return '0';if(a>=1e4)return (v/1e3).toPrecision(3)+'k';
 if(a>=100)return v.toFixed(0);if(a>=0.01)return v.toPrecision(3);return v.toExponential(1);}
function nearest(pts,px){var lo=0,hi=pts.length-1;while(hi-lo>1){var m=(lo+hi)>>1;
 if(pts[m][0]<px)lo=m;else hi=m;}
 return Math.abs(pts[lo][0]-px)<=Math.abs(pts[hi][0]-px)?pts[lo]:pts[hi];}
document.querySelectorAll('svg.chart').forEach(function(svg){
 var d=svg.dataset,L=+d.left,R=+d.right,T=+d.top,B=+d.bottom,x0=+d.x0,x1=+d.x1,y0=+d.y0,
 y1=+d.y1,W=svg.viewBox.baseVal.width,cur=svg.querySelector('.cursor');
 var lines=Array.prototype.map.call(svg.querySelectorAll('polyline:not([data-hover=off])'),
  function(p){
  return {label:p.getAttribute('data-label'),pts:p.getAttribute('points').split(' ')
  .map(function(s){var a=s.split(',');return [+a[0],+a[1]];})};});
 function hide(){tip.hidden=true;cur.setAttribute('visibility','hidden');}
 svg.addEventListener('mousemove',function(ev){
  var r=svg.getBoundingClientRect(),px=(ev.clientX-r.left)/r.width*W;
  if(px<L||px>R||!lines.length){hide();return;}
  cur.setAttribute('x1',px);cur.setAttribute('x2',px);cur.setAttribute('visibility','visible');
  var x=x0+(px-L)/(R-L)*(x1-x0);
  if(d.xscale==='log2')x=Math.round(Math.pow(2,x));
  var out=[d.xlabel==='step'||d.xscale==='log2'?d.xlabel+' '+Math.round(x):d.xlabel+' '+
   x.toFixed(1)];
  lines.forEach(function(l){var p=nearest(l.pts,px);
   out.push(l.label+': '+fmt(y0+(B-p[1])/(B-T)*(y1-y0)));});
  tip.textContent=out.join('\\n');tip.style.left=(ev.pageX+14)+'px';
  tip.style.top=(ev.pageY+14)+'px';tip.hidden=false;});
 svg.addEventListener('mouseleave',hide);});
document.documentElement.setAttribute('data-js','ok');
})();
"""


@dataclass
class _Axis:
    """The x of every row: the training step, or elapsed seconds for wall-clock rows
    (``gpulens record``); rows of different runs are never joined by a line."""

    label: str
    xs: list[float]
    runs: list[int]

    @property
    def range(self) -> tuple[float, float]:
        return (min(self.xs), max(self.xs)) if self.xs else (0.0, 1.0)


def _axis(record: Record) -> _Axis:
    runs = record.run_of_row or [1] * len(record.rows)
    if record.trained:
        return _Axis("step", [float(r.step) for r in record.rows], runs)
    starts = {r.number: r.start_time for r in record.selected}
    first: dict[int, float] = {}
    for n, r in zip(runs, record.rows, strict=True):
        first.setdefault(n, r.time)
    xs = []
    for n, r in zip(runs, record.rows, strict=True):
        elapsed = r.values.get("record/elapsed_s")
        if elapsed is None:
            start = starts.get(n)
            origin = start if start is not None and start <= first[n] else first[n]
            elapsed = r.time - origin
        xs.append(float(elapsed))
    return _Axis("elapsed s", xs, runs)


def _points(record: Record, axis: _Axis, key: str) -> dict[int, list[tuple[float, float]]]:
    """Finite points of ``key`` per run number, in row order."""
    out: dict[int, list[tuple[float, float]]] = {}
    for x, n, r in zip(axis.xs, axis.runs, record.rows, strict=True):
        v = r.values.get(key)
        if v is not None and math.isfinite(v):  # a NaN loss: in the headline, not a point
            out.setdefault(n, []).append((x, v))
    return out


def _lines(record: Record, axis: _Axis, key: str, label: str, col: str, dash: str | None = None,
           width: float = 1.8, legend: bool = True) -> list[Series]:
    """One series per run (same colour; the legend names it once)."""
    return [Series(label, pts, col, dash, width, legend and i == 0)
            for i, pts in enumerate(_points(record, axis, key).values())]


def _gpus(record: Record) -> list[str]:
    found: set[str] = set()
    for r in record.rows:
        for k in r.values:
            m = _GPU_KEY.match(k)
            if m:
                found.add(m.group(1))
    return sorted(found, key=int)


def _utc(t: float | None) -> str:
    if t is None:
        return "n/a"
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _charts(record: Record, summary: RunSummary) -> tuple[list[str], list[str]]:
    """(training charts, GPU charts) as HTML figures, leaving out those with no data."""
    axis = _axis(record)
    xr = axis.range
    gpus = _gpus(record)
    several = len(record.selected) > 1

    def one(cid: str, title: str, unit: str, key: str, y_label: str,
            floor: float | None = 0.0) -> str | None:
        per_run = _points(record, axis, key)
        if not per_run:
            return None
        if several:
            series = [Series(f"run {n}", pts, color(i)) for i, (n, pts) in
                      enumerate(per_run.items())]
        else:
            series = [Series(key, pts, color(0)) for pts in per_run.values()]
        return line_chart(cid, title, unit, series, xr, y_floor=floor, x_label=axis.label,
                          y_label=y_label)

    def per_gpu(
        cid: str, title: str, unit: str, y_label: str, build: Callable[[int, str], list[Series]],
        floor: float | None = 0.0, ceiling: float | None = None,
    ) -> str | None:
        series = [s for i, g in enumerate(gpus) for s in build(i, g) if s.points]
        if not series:
            return None
        return line_chart(cid, title, unit, series, xr, y_floor=floor, y_ceiling=ceiling,
                          x_label=axis.label, y_label=y_label)

    def activity(i: int, g: str) -> list[Series]:
        sm = _lines(record, axis, f"gpu/{g}/sm_active_pct", f"GPU {g} SM active", color(i))
        if sm:
            return sm + _lines(record, axis, f"gpu/{g}/tensor_active_pct",
                               f"GPU {g} tensor active", color(i), "5 3", 1.4)
        return _lines(record, axis, f"gpu/{g}/util_pct", f"GPU {g} util", color(i))

    def simple(suffix: str) -> Callable[[int, str], list[Series]]:
        return lambda i, g: _lines(record, axis, f"gpu/{g}/{suffix}", f"GPU {g}", color(i))

    def power(i: int, g: str) -> list[Series]:
        return (_lines(record, axis, f"gpu/{g}/power_w", f"GPU {g}", color(i))
                + _lines(record, axis, f"gpu/{g}/power_limit_w", f"GPU {g} limit", color(i),
                         "2 4", 1.2, legend=False))

    totals = {g.gpu: g.mem_total_gb for g in summary.gpus if g.mem_total_gb}

    def memory(i: int, g: str) -> list[Series]:
        used = _lines(record, axis, f"gpu/{g}/mem_used_gb", f"GPU {g}", color(i))
        total = totals.get(g)
        if total is None or not used:
            return used
        return [*used, Series(f"GPU {g} total", [(xr[0], total), (xr[1], total)], color(i),
                              "2 4", 1.2, legend=False)]

    train = [
        one("chart-loss", "Loss", "train/loss", "train/loss", "loss", None),
        one("chart-lr", "Learning rate", "train/learning_rate", "train/learning_rate",
            "learning rate"),
        one("chart-grad-norm", "Gradient norm", "train/grad_norm", "train/grad_norm",
            "gradient norm"),
        one("chart-step-time", "Step time", "seconds (perf/step_time_s)", "perf/step_time_s",
            "s"),
    ]
    gpu = [
        per_gpu("chart-activity", "GPU activity", "% (SM / tensor active where GPM exists, "
                "else NVML util)", "%", activity, 0.0, 100.0),
        per_gpu("chart-memory", "GPU memory used", "GB = 10⁹ bytes (dotted: total)", "GB",
                memory),
        per_gpu("chart-power", "GPU power", "W (dotted: limit)", "W", power),
        per_gpu("chart-temp", "GPU temperature", "°C", "°C", simple("temp_c"), None),
        per_gpu("chart-throttle", "Clocks held down", "% of time (power cap, thermal, ...)",
                "% of time", simple("throttle_pct"), 0.0, 100.0),
    ]
    if not record.trained:  # e.g. `gpulens record`: rows are wall-clock intervals
        train = []
    return [c for c in train if c], [c for c in gpu if c]


def tensor_active_mean(values: dict[str, float]) -> float | None:
    """GPM tensor-pipe activity of one row, mean over its GPUs (%); ``None`` without GPM."""
    found = [v for k, v in values.items()
             if k.endswith("/tensor_active_pct") and _GPU_ONE.match(k)]
    return sum(found) / len(found) if found else None


_GPU_ONE = re.compile(r"^gpu/\d+/tensor_active_pct$")


def _perf_charts(record: Record) -> list[str]:
    """Throughput and MFU charts on the rows' axis, leaving out those with no data."""
    axis = _axis(record)
    xr = axis.range

    def chart(cid: str, title: str, unit: str, y_label: str, series: list[Series]) -> str | None:
        series = [s for s in series if s.points]
        if not series:
            return None
        return line_chart(cid, title, unit, series, xr, y_floor=0.0, x_label=axis.label,
                          y_label=y_label)

    tensor: dict[int, list[tuple[float, float]]] = {}
    for x, n, r in zip(axis.xs, axis.runs, record.rows, strict=True):
        if "perf/mfu_pct" in r.values and (t := tensor_active_mean(r.values)) is not None:
            tensor.setdefault(n, []).append((x, t))
    tensor_lines = [Series("tensor active (GPM, mean of GPUs)", pts, color(2), "2 3", 1.4,
                           i == 0) for i, pts in enumerate(tensor.values())]
    charts = [
        chart("chart-tokens", "Throughput", "tokens/s, all GPUs (perf/tokens_per_s)",
              "tokens/s", _lines(record, axis, "perf/tokens_per_s", "tokens/s", color(0))),
        chart("chart-samples", "Throughput", "samples/s, all GPUs (perf/samples_per_s)",
              "samples/s", _lines(record, axis, "perf/samples_per_s", "samples/s", color(0))),
        chart("chart-tflops", "Achieved TFLOP/s per GPU", "model TFLOP/s (perf/tflops)",
              "TFLOP/s", _lines(record, axis, "perf/tflops", "TFLOP/s per GPU", color(4))),
        chart("chart-mfu", "MFU beside tensor-core activity",
              "% (MFU; dashed: clock-adjusted; dotted: GPM tensor active)", "%",
              _lines(record, axis, "perf/mfu_pct", "MFU", color(1))
              + _lines(record, axis, "perf/mfu_clock_adjusted_pct", "MFU clock-adjusted",
                       color(1), "6 3", 1.4)
              + tensor_lines),
        chart("chart-mfu-tensor", "MFU while the tensor cores were busy",
              "% of peak (perf/mfu_when_tensor_active_pct)", "%",
              _lines(record, axis, "perf/mfu_when_tensor_active_pct", "MFU / tensor active",
                     color(6))),
    ]
    return [c for c in charts if c]


def _perf_table(record: Record, t: Throughput) -> str:
    rows: list[tuple[str, str]] = []
    unit = t.unit
    if t.per_s is not None:
        rows.append(("Throughput", f"{figure(t.per_s)} {unit}/s (all GPUs)"))
    if t.work is not None:
        rows.append(("Work", f"{figure(t.work)} {unit}"))
    if t.tflops is not None:
        job = f"; {sized(t.tflops_job)} for the job" if t.tflops_job is not None else ""
        rows.append(("Achieved", f"{sized(t.tflops)} TFLOP/s per GPU{job}"))
    if t.mfu_pct is not None:
        rows.append(("MFU", f"{sized(t.mfu_pct)} %"))
    if t.mfu_clock_adjusted_pct is not None:
        rows.append(("MFU, clock-adjusted", f"{sized(t.mfu_clock_adjusted_pct)} % (against the "
                     "peak at the SM clock the GPUs ran)"))
    if t.tensor_active_pct is not None:
        rows.append(("Tensor cores active (GPM)", f"{t.tensor_active_pct:.1f} % of the time"))
    if t.mfu_when_tensor_active_pct is not None:
        rows.append(("MFU while tensor cores were busy",
                     f"{sized(t.mfu_when_tensor_active_pct)} % ({_busy_or_idle(t)})"))
    if t.per_j is not None:
        rows.append((f"{unit.capitalize()} per joule", f"{figure(t.per_j)} {unit}/J"))
    body = "".join(f"<tr><th>{escape(a)}</th><td>{escape(b)}</td></tr>" for a, b in rows)
    notes = ['<p class="note mfu-denominator">'
             + (f"<b>{escape(label)}</b>: " if label else "") + f"{escape(text)}</p>"
             for label, text in mfu_notes(record, t)]
    return f'<table id="perf" class="narrow">{body}</table>' + "".join(notes)


def _busy_or_idle(t: Throughput) -> str:
    """What the comparison of MFU with tensor-core activity says, in words."""
    busy, when = t.tensor_active_pct, t.mfu_when_tensor_active_pct
    if busy is None or when is None:
        return ""
    if when > 100:
        return "above 100 %: the FLOP count, the peak or the GPM reading disagree"
    if busy >= 50 and when < 50:
        return "the tensor cores were busy but slow: small or badly shaped products, low clock"
    if busy < 50 and when >= 50:
        return "the tensor cores were often idle: time went to other work"
    return "of the peak, while the tensor pipes ran"


def _kpis(summary: RunSummary) -> str:
    items: list[tuple[str, str]] = []
    if summary.steps is not None:
        items.append((str(summary.steps), "steps"))
    items.append((duration(summary.duration_s), "duration"))
    items.append((energy_text(summary.energy_wh),
                  "GPU energy" + of_gpus(summary, summary.energy_gpus)))
    if summary.power_mean_w is not None:
        items.append((f"{summary.power_mean_w:.0f} W", "mean GPU power ("
                      + (of_gpus(summary, summary.power_gpus).strip(" ()") or "all GPUs") + ")"))
    if summary.energy_per_step_j is not None:
        items.append((f"{summary.energy_per_step_j:.1f} J", "energy per step"))
    if summary.step_time_mean_s is not None:
        items.append((f"{summary.step_time_mean_s * 1000:.0f} ms",
                      "mean step time (duration / steps)"))
    if summary.loss_last is not None:
        items.append((f"{summary.loss_last:.4g}", f"final loss (first {summary.loss_first:.4g})"))
    for key, (rows, first) in summary.not_finite.items():
        items.append(("NaN/inf", f"{key.removeprefix('train/')} not finite in {rows} row(s), "
                      f"first at step {first}"))
    t = summary.throughput
    if t is not None and t.per_s is not None:
        items.append((f"{figure(t.per_s)} {t.unit}/s", f"throughput ({t.unit} per second)"))
    if t is not None and t.mfu_pct is not None:
        peak = summary.meta.get("peak_dtype")
        items.append((f"{sized(t.mfu_pct)} %", f"MFU (of the dense {peak} peak)" if peak
                      else "MFU"))
    e = summary.efficiency
    if e is not None and e.per_joule is not None:
        items.append((f"{figure(e.per_joule)} {e.unit}/J", f"efficiency ({e.unit} per joule)"))
    return "".join(
        f'<div class="kpi"><div class="v">{escape(v)}</div>'
        f'<div class="l">{escape(label)}</div></div>'
        for v, label in items
    )


def _table(record: Record, summary: RunSummary) -> str:
    if not summary.gpus:
        return "<p>No GPU metrics in this record.</p>"
    head = "".join(f"<th>{escape(h)}</th>" for h in (*HEADERS, "Activity over the run"))
    body = []
    axis = _axis(record)
    for g in summary.gpus:
        key = f"gpu/{g.gpu}/{g.activity_metric or 'util_pct'}"
        values = [v for pts in _points(record, axis, key).values() for _, v in pts]
        spark = sparkline(values, 20, 0.0, 100.0)
        cells = "".join(f"<td>{escape(c)}</td>" for c in gpu_cells(g))
        body.append(f'<tr data-gpu="{escape(g.gpu)}">{cells}<td class="spark">{spark}</td></tr>')
    return (f'<div class="scroll"><table id="summary"><tr>{head}</tr>{"".join(body)}</table>'
            "</div><p class=note>Memory in GB of 10⁹ bytes, as NVML counts it; a GiB is 2³⁰ "
            "bytes, so an \u201c80GB\u201d card shows 85.9 GB (80.0 GiB).</p>")


def _energy(summary: RunSummary) -> str:
    rows = []
    for g in summary.gpus:
        if g.energy_wh is not None:
            rows.append((f"GPU {g.gpu}", f"{energy_text(g.energy_wh)} ({g.energy_source})"))
    if summary.energy_wh is not None:
        rows.append(("All GPUs", energy_text(summary.energy_wh)))
    if summary.energy_per_step_j is not None:
        rows.append(("Energy per training step", f"{summary.energy_per_step_j:.2f} J"))
        rows.append(("Steps per kWh", f"{3.6e6 / summary.energy_per_step_j:,.0f}"))
    e = summary.efficiency
    if e is not None and e.source == "given":
        rows.append(("Work", f"{e.work:g} {e.unit}"))
        if e.per_joule is not None:
            rows.append(("Efficiency", f"{figure(e.per_joule)} {e.unit}/J"))
        if e.per_second is not None:
            rows.append(("Throughput", f"{figure(e.per_second)} {e.unit}/s"))
    elif e is not None and e.per_joule is not None:
        rows.append(("Efficiency", f"{figure(e.per_joule)} {e.unit}/J"))
        rows.append(("Efficiency from", f"the engine's perf/{e.unit}_per_j: {e.unit} over the "
                     "GPUs' energy in the same windows"))
    if not rows:
        return "<p>No energy or power readings in this record.</p>"
    body = "".join(f"<tr><th>{escape(a)}</th><td>{escape(b)}</td></tr>" for a, b in rows)
    return f'<table id="energy" class="narrow">{body}</table>'


def gpu_models(record: Record, summary: RunSummary) -> str:
    """``"2 x NVIDIA H100 80GB HBM3"``, ``"NVIDIA A100, NVIDIA L4"``, or ``""``."""
    names = [record.gpu_names.get(g.gpu) or g.name for g in summary.gpus]
    if not summary.gpus:
        names = list(record.gpu_names.values())
    counts: dict[str, int] = {}
    for n in names:
        if n:
            counts[n] = counts.get(n, 0) + 1
    return ", ".join(f"{c} x {n}" if c > 1 else n for n, c in counts.items())


def backend_text(record: Record) -> str:
    """What sampled the GPUs, in words."""
    backend = record.backend
    if backend is None:
        return "backend not recorded (a file without a run header)"
    if backend == "simulated":
        return "backend: simulated (GPULENS_BACKEND=simulated)"
    if backend == "none":
        return "backend: none (no NVIDIA driver answered: no GPU metrics)"
    return f"backend: {backend}"


SIMULATED_BANNER = ("SIMULATED GPUs: gpulens's GPU simulator made the GPU figures of this report. "
                    "They describe no real hardware.")


def _runs(record: Record) -> str:
    if len(record.runs) <= 1:
        return ""
    chosen = {r.number for r in record.selected}
    head = "".join(f"<th>{h}</th>" for h in ("Run", "Run id", "Started", "Backend", "Rows",
                                               "Steps", "Ended cleanly"))
    body = []
    for r in record.runs:
        steps = f"{r.first_step} to {r.last_step}" if r.first_step is not None else "n/a"
        cells = (str(r.number), r.run_id or "(no header)", _utc(r.start_time),
                 r.backend or "n/a", str(r.rows), steps,
                 "yes" if r.ended else "no (killed, or still running)")
        mark = ' class="chosen"' if r.number in chosen else ""
        body.append(f"<tr{mark}>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    return (f"<h2>Runs in this file</h2><p class=note>This report shows "
            f"{'all runs' if len(chosen) == len(record.runs) else escape(_chosen_text(record))}"
            "; <code>gpulens report FILE --run N</code> (or a run id, or <code>all</code>) "
            "picks others.</p>"
            f'<div class="scroll"><table id="runs"><tr>{head}</tr>{"".join(body)}</table></div>')


def _chosen_text(record: Record) -> str:
    return ", ".join(r.label for r in record.selected)


def _events(record: Record) -> str:
    if not record.events:
        return ""
    head = "".join(f"<th>{h}</th>" for h in ("Step", "Time", "Kind", "What", "Message",
                                               "Advice"))
    body = []
    for e in record.events:
        what = f"{e.name} ({e.state})" if e.state else e.name
        cells = (str(e.step), _utc(e.time), f"{e.kind} · {e.severity}", what, e.message,
                 e.advice)
        body.append(f'<tr class="{escape(e.severity)}">'
                    + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    return (f"<h2>Alerts and notices</h2><div class=\"scroll\"><table id=\"events\">"
            f"<tr>{head}</tr>{''.join(body)}</table></div>")


def render_html(record: Record, summary: RunSummary, title: str | None = None) -> str:
    """The whole report page as one string."""
    title = title or f"gpulens report: {record.path.name}"
    train, gpu = _charts(record, summary)
    if not record.trained:  # steps are interval numbers: per-step figures mean nothing
        summary = dataclasses.replace(summary, steps=None, energy_per_step_j=None,
                                      step_time_mean_s=None)
    perf_charts = _perf_charts(record) if summary.throughput is not None else []
    if train:  # throughput and MFU below the training charts, beside the GPUs' activity
        charts = (
            '<div class="cols"><div class="col"><div class="colhead">Training</div>'
            + "".join(train + perf_charts)
            + '</div><div class="col"><div class="colhead">GPUs</div>'
            + "".join(gpu)
            + "</div></div>"
        )
    else:
        charts = '<div class="grid2">' + "".join(gpu + perf_charts) + "</div>"
    models = gpu_models(record, summary)
    host = {r.hostname for r in record.selected if r.hostname}
    sub = " · ".join(part for part in (
        f"{summary.rows} rows",
        f"{_utc(summary.start_time)} → {_utc(summary.end_time)}",
        f"{len(summary.gpus)} GPU(s)" + (f": {models}" if models else ""),
        backend_text(record),
        ("host " + ", ".join(sorted(host))) if host else "",
        (_chosen_text(record) + f" of {len(record.runs)} in this file")
        if len(record.runs) > 1 else "",
    ) if part)
    banner = (f'<div class="banner" id="simulated"><b>SIMULATED GPUs</b>: '
              f"{escape(SIMULATED_BANNER.split(': ', 1)[1])}</div>" if record.simulated else "")
    note = (
        f"<p class=note>{record.skipped} malformed line(s) skipped.</p>" if record.skipped else ""
    )
    heading = ("Training and GPUs, by step" if train
               else "GPUs, by elapsed time (seconds since the start)")
    perf = ""
    if summary.throughput is not None:
        perf = f"<h2>Throughput and MFU</h2>{_perf_table(record, summary.throughput)}"
    return (
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body><main>"
        f"<h1>{escape(title)}</h1>{banner}<div class=sub>{escape(sub)}</div>"
        f'<div class="kpis">{_kpis(summary)}</div>'
        f"<h2>{heading}</h2>{charts}"
        f"<h2>Per GPU</h2>{_table(record, summary)}{perf}"
        f"<h2>Energy and efficiency</h2>{_energy(summary)}"
        f"{_events(record)}{_runs(record)}"
        f"{note}<p class=note>Made by gpulens from {escape(str(record.path))}. Means are "
        "time-weighted over each row's window; energy comes from NVML's energy counter where "
        "the GPU has one; the mean step time is the duration divided by the steps.</p>"
        '<div id="js-errors" hidden></div><div id="tip" hidden></div>'
        f"</main><script>{SCRIPT}</script></body></html>"
    )
