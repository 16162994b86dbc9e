"""Reports from a JSONL record: one self-contained HTML page and a Markdown summary.

>>> from gpulens.report import load_jsonl, summarize, render_html, render_markdown
>>> record = load_jsonl("runs/gpu.jsonl")          # doctest: +SKIP
>>> html = render_html(record, summarize(record))  # doctest: +SKIP

The command line front is ``gpulens report RUN.jsonl [-o report.html] [--markdown [FILE]]
[--run last|N|ID|all]``: a JSONL file may hold several runs (the jsonl sink appends), and the
report shows the last one unless ``--run`` (``load_jsonl(path, run=...)``) chooses.
"""

from __future__ import annotations

import dataclasses

from gpulens.model import Row
from gpulens.report.html import SIMULATED_BANNER, backend_text, gpu_models, render_html
from gpulens.report.load import GpuMeta, Record, ReportError, RunInfo, load_jsonl
from gpulens.report.summary import (
    Efficiency,
    GpuSummary,
    RunSummary,
    SummaryBuilder,
    Throughput,
)
from gpulens.report.text import (
    figure,
    mfu_notes,
    render_markdown_summary,
    render_text,
    sparkline,
)

__all__ = [
    "Efficiency",
    "GpuMeta",
    "GpuSummary",
    "Record",
    "ReportError",
    "RunInfo",
    "RunSummary",
    "SummaryBuilder",
    "Throughput",
    "load_jsonl",
    "render_html",
    "render_markdown",
    "render_text",
    "summarize",
]


def summarize(record: Record, work: float | None = None, unit: str = "units") -> RunSummary:
    """Fold all rows of ``record`` into a :class:`RunSummary`, run by run (each run's first
    window starts at its header's time where the file has one)."""
    builder = SummaryBuilder(gpu_names=record.gpu_names, mem_total_gb=record.mem_total_gb,
                             backend=record.backend, meta=record.meta)
    starts = {r.number: r.start_time for r in record.selected}
    by_run: dict[int, list[Row]] = {}
    for number, row in zip(record.run_of_row or [0] * len(record.rows), record.rows,
                           strict=True):
        by_run.setdefault(number, []).append(row)
    for number, rows in by_run.items():
        start = starts.get(number)
        builder.begin_run(start if start is not None and rows and start <= rows[0].time
                          else None)
        for row in rows:
            builder.add(row.step, row.time, row.values)
    return builder.result(work=work, unit=unit)


def render_markdown(record: Record, summary: RunSummary, title: str | None = None) -> str:
    """Markdown for a pull-request comment: headline, per-GPU table, sparklines by step."""
    if not record.trained:
        summary = dataclasses.replace(summary, steps=None, first_step=None, last_step=None,
                                      energy_per_step_j=None, step_time_mean_s=None)
    text = render_markdown_summary(summary, title or f"gpulens report: {record.path.name}")
    heading, _, rest = text.partition("\n")
    models = gpu_models(record, summary)
    meta = [f"{len(summary.gpus)} GPU(s)" + (f": {models}" if models else ""),
            backend_text(record)]
    if len(record.runs) > 1:
        meta.append(", ".join(r.label for r in record.selected)
                    + f" of {len(record.runs)} in this file (`--run N|ID|all` for others)")
    lines_meta = [heading, ""]
    if record.simulated:
        lines_meta.append(f"> **{SIMULATED_BANNER.split(':', 1)[0]}**:"
                          f"{SIMULATED_BANNER.split(':', 1)[1]}")
        lines_meta.append("")
    lines_meta.append(" · ".join(meta))
    text = "\n".join(lines_meta) + "\n" + rest
    lines = []
    for key, label, unit in (("train/loss", "loss", ""), ("perf/step_time_s", "step time", " s"),
                             ("perf/tokens_per_s", "tokens/s", ""),
                             ("perf/samples_per_s", "samples/s", ""),
                             ("perf/tflops", "TFLOP/s per GPU", ""),
                             ("perf/mfu_pct", "MFU", " %")):
        if not record.trained:
            break
        vals = [r.values[key] for r in record.rows if key in r.values]
        if vals:
            lines.append(f"| {label} | `{sparkline(vals)}` | {_fig(min(vals))} to "
                         f"{_fig(max(vals))}{unit} |")
    for g in summary.gpus:
        metric = g.activity_metric or "util_pct"
        vals = [r.values[f"gpu/{g.gpu}/{metric}"] for r in record.rows
                if f"gpu/{g.gpu}/{metric}" in r.values]
        if vals:
            lines.append(
                f"| GPU {g.gpu} {metric} | `{sparkline(vals, lo=0, hi=100)}` | "
                f"{min(vals):.0f} to {max(vals):.0f} % |"
            )
    if lines:
        text += "\n| by step | trend | range |\n|---|---|---|\n" + "\n".join(lines) + "\n"
    if summary.throughput is not None:
        text += "".join(f"\n_{_md((label + ': ') if label else '')}{_md(note)}_\n"
                        for label, note in mfu_notes(record, summary.throughput))
    if record.events:
        text += ("\n| step | event | what | message | what to try |\n|---|---|---|---|---|\n"
                 + "".join(f"| {e.step} | {e.kind} · {e.severity} | {_md(e.name)} "
                           f"({_md(e.state)}) | {_md(e.message)} | {_md(e.advice)} |\n"
                           for e in record.events))
    text += ("\n_Memory in GB of 10⁹ bytes (an “80GB” card shows 85.9 GB = 80.0 GiB); the mean "
             "step time is the duration divided by the steps._\n")
    if record.skipped:
        text += f"\n_{record.skipped} malformed line(s) skipped._\n"
    return text


def _md(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def _fig(v: float) -> str:
    return figure(v) if abs(v) >= 1000 else f"{v:.4g}"
