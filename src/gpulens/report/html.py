"""One self-contained HTML page: inline CSS, inline SVG charts, a few lines of inline script
for hover read-outs.  Nothing is fetched at view time.

Layout: training charts (loss, learning rate, gradient norm, step time) in the left column,
beside the GPU charts (activity, memory, power, temperature, clocks held down) in the right, all
on the same step axis with one line per GPU; then the per-GPU summary table, energy and
efficiency.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Callable
from html import escape

from gpulens.report.load import Record
from gpulens.report.summary import RunSummary
from gpulens.report.svg import Series, color, line_chart
from gpulens.report.text import HEADERS, duration, energy_text, gpu_cells, sparkline

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
.note{color:var(--muted);font-size:12px;margin-top:18px}
@media (max-width:900px){.cols,.grid2{grid-template-columns:1fr}}
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
 var lines=Array.prototype.map.call(svg.querySelectorAll('polyline'),function(p){
  return {label:p.getAttribute('data-label'),pts:p.getAttribute('points').split(' ')
  .map(function(s){var a=s.split(',');return [+a[0],+a[1]];})};});
 function hide(){tip.hidden=true;cur.setAttribute('visibility','hidden');}
 svg.addEventListener('mousemove',function(ev){
  var r=svg.getBoundingClientRect(),px=(ev.clientX-r.left)/r.width*W;
  if(px<L||px>R||!lines.length){hide();return;}
  cur.setAttribute('x1',px);cur.setAttribute('x2',px);cur.setAttribute('visibility','visible');
  var out=['step '+Math.round(x0+(px-L)/(R-L)*(x1-x0))];
  lines.forEach(function(l){var p=nearest(l.pts,px);
   out.push(l.label+': '+fmt(y0+(B-p[1])/(B-T)*(y1-y0)));});
  tip.textContent=out.join('\\n');tip.style.left=(ev.pageX+14)+'px';
  tip.style.top=(ev.pageY+14)+'px';tip.hidden=false;});
 svg.addEventListener('mouseleave',hide);});
document.documentElement.setAttribute('data-js','ok');
})();
"""


def _series(record: Record, key: str) -> list[tuple[float, float]]:
    return [(float(r.step), r.values[key]) for r in record.rows if key in r.values]


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
    steps = [float(r.step) for r in record.rows]
    xr = (min(steps), max(steps)) if steps else (0.0, 1.0)
    gpus = _gpus(record)

    def one(cid: str, title: str, unit: str, key: str, floor: float | None = 0.0) -> str | None:
        pts = _series(record, key)
        if not pts:
            return None
        return line_chart(cid, title, unit, [Series(key, pts, color(0))], xr, y_floor=floor)

    def per_gpu(
        cid: str, title: str, unit: str, build: Callable[[int, str], list[Series]],
        floor: float | None = 0.0, ceiling: float | None = None,
    ) -> str | None:
        series = [s for i, g in enumerate(gpus) for s in build(i, g) if s.points]
        if not series:
            return None
        return line_chart(cid, title, unit, series, xr, y_floor=floor, y_ceiling=ceiling)

    def activity(i: int, g: str) -> list[Series]:
        sm = _series(record, f"gpu/{g}/sm_active_pct")
        if sm:
            return [
                Series(f"GPU {g} SM active", sm, color(i)),
                Series(f"GPU {g} tensor active", _series(record, f"gpu/{g}/tensor_active_pct"),
                       color(i), "5 3", 1.4),
            ]
        return [Series(f"GPU {g} util", _series(record, f"gpu/{g}/util_pct"), color(i))]

    def simple(suffix: str, label: str) -> Callable[[int, str], list[Series]]:
        return lambda i, g: [Series(f"GPU {g}{label}", _series(record, f"gpu/{g}/{suffix}"),
                                    color(i))]

    def power(i: int, g: str) -> list[Series]:
        return [
            Series(f"GPU {g}", _series(record, f"gpu/{g}/power_w"), color(i)),
            Series(f"GPU {g} limit", _series(record, f"gpu/{g}/power_limit_w"), color(i),
                   "2 4", 1.2, legend=False),
        ]

    totals = {g.gpu: g.mem_total_gb for g in summary.gpus if g.mem_total_gb}

    def memory(i: int, g: str) -> list[Series]:
        used = Series(f"GPU {g}", _series(record, f"gpu/{g}/mem_used_gb"), color(i))
        total = totals.get(g)
        if total is None or not used.points:
            return [used]
        return [used, Series(f"GPU {g} total", [(xr[0], total), (xr[1], total)], color(i),
                             "2 4", 1.2, legend=False)]

    train = [
        one("chart-loss", "Loss", "train/loss", "train/loss", None),
        one("chart-lr", "Learning rate", "train/learning_rate", "train/learning_rate"),
        one("chart-grad-norm", "Gradient norm", "train/grad_norm", "train/grad_norm"),
        one("chart-step-time", "Step time", "seconds (perf/step_time_s)", "perf/step_time_s"),
    ]
    gpu = [
        per_gpu("chart-activity", "GPU activity", "% (SM / tensor active where GPM exists, "
                "else NVML util)", activity, 0.0, 100.0),
        per_gpu("chart-memory", "GPU memory used", "GB (dotted: total)", memory),
        per_gpu("chart-power", "GPU power", "W (dotted: limit)", power),
        per_gpu("chart-temp", "GPU temperature", "°C", simple("temp_c", ""), None),
        per_gpu("chart-throttle", "Clocks held down", "% of time (power cap, thermal, ...)",
                simple("throttle_pct", ""), 0.0, 100.0),
    ]
    if not record.trained:  # e.g. `gpulens record`: rows are wall-clock intervals
        train = []
    return [c for c in train if c], [c for c in gpu if c]


def _kpis(summary: RunSummary) -> str:
    items: list[tuple[str, str]] = []
    if summary.steps is not None:
        items.append((str(summary.steps), "steps"))
    items.append((duration(summary.duration_s), "duration"))
    items.append((energy_text(summary.energy_wh), "GPU energy"))
    if summary.power_mean_w is not None:
        items.append((f"{summary.power_mean_w:.0f} W", "mean GPU power (all GPUs)"))
    if summary.energy_per_step_j is not None:
        items.append((f"{summary.energy_per_step_j:.1f} J", "energy per step"))
    if summary.step_time_mean_s is not None:
        items.append((f"{summary.step_time_mean_s * 1000:.0f} ms", "mean step time"))
    if summary.loss_last is not None:
        items.append((f"{summary.loss_last:.4g}", f"final loss (first {summary.loss_first:.4g})"))
    e = summary.efficiency
    if e is not None and e.per_joule is not None:
        items.append((f"{e.per_joule:.4g}", f"{e.unit} per joule"))
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
    for g in summary.gpus:
        key = f"gpu/{g.gpu}/{g.activity_metric or 'util_pct'}"
        spark = sparkline([v for _, v in _series(record, key)], 20, 0.0, 100.0)
        cells = "".join(f"<td>{escape(c)}</td>" for c in gpu_cells(g))
        body.append(f'<tr data-gpu="{escape(g.gpu)}">{cells}<td class="spark">{spark}</td></tr>')
    return f'<table id="summary"><tr>{head}</tr>{"".join(body)}</table>'


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
    if e is not None:
        rows.append(("Work", f"{e.work:g} {e.unit}"))
        if e.per_joule is not None:
            rows.append((f"{e.unit} per joule", f"{e.per_joule:.4g}"))
        if e.per_second_per_watt is not None:
            rows.append((f"{e.unit}/s per watt", f"{e.per_second_per_watt:.4g}"))
    if not rows:
        return "<p>No energy or power readings in this record.</p>"
    body = "".join(f"<tr><th>{escape(a)}</th><td>{escape(b)}</td></tr>" for a, b in rows)
    return f'<table id="energy" style="width:auto">{body}</table>'


def render_html(record: Record, summary: RunSummary, title: str | None = None) -> str:
    """The whole report page as one string."""
    title = title or f"gpulens report: {record.path.name}"
    train, gpu = _charts(record, summary)
    if not record.trained:  # steps are interval numbers: per-step figures mean nothing
        summary = dataclasses.replace(summary, steps=None, energy_per_step_j=None,
                                      step_time_mean_s=None)
    if train:
        charts = (
            '<div class="cols"><div class="col"><div class="colhead">Training</div>'
            + "".join(train)
            + '</div><div class="col"><div class="colhead">GPUs</div>'
            + "".join(gpu)
            + "</div></div>"
        )
    else:
        charts = '<div class="grid2">' + "".join(gpu) + "</div>"
    names = sorted({g.name for g in summary.gpus if g.name})
    sub = (
        f"{summary.rows} rows · {_utc(summary.start_time)} → {_utc(summary.end_time)} · "
        f"{len(summary.gpus)} GPU(s){(' · ' + ', '.join(names)) if names else ''}"
    )
    note = (
        f"<p class=note>{record.skipped} malformed line(s) skipped.</p>" if record.skipped else ""
    )
    return (
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body><main>"
        f"<h1>{escape(title)}</h1><div class=sub>{escape(sub)}</div>"
        f'<div class="kpis">{_kpis(summary)}</div>'
        f"<h2>{'Training and GPUs, by step' if train else 'GPUs, by row'}</h2>{charts}"
        f"<h2>Per GPU</h2>{_table(record, summary)}"
        f"<h2>Energy and efficiency</h2>{_energy(summary)}"
        f"{note}<p class=note>Made by gpulens from {escape(str(record.path))}. Means are "
        "time-weighted over each row's window; energy comes from NVML's energy counter where "
        "the GPU has one.</p>"
        '<div id="js-errors" hidden></div><div id="tip" hidden></div>'
        f"</main><script>{SCRIPT}</script></body></html>"
    )
