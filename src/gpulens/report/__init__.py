"""Reports from a JSONL record: one self-contained HTML page and a Markdown summary.

>>> from gpulens.report import load_jsonl, summarize, render_html, render_markdown
>>> record = load_jsonl("runs/gpu.jsonl")          # doctest: +SKIP
>>> html = render_html(record, summarize(record))  # doctest: +SKIP

The command line front is ``gpulens report RUN.jsonl [-o report.html] [--markdown [FILE]]``.
"""

from __future__ import annotations

import dataclasses

from gpulens.report.html import render_html
from gpulens.report.load import Record, ReportError, load_jsonl
from gpulens.report.summary import Efficiency, GpuSummary, RunSummary, SummaryBuilder
from gpulens.report.text import render_markdown_summary, render_text, sparkline

__all__ = [
    "Efficiency",
    "GpuSummary",
    "Record",
    "ReportError",
    "RunSummary",
    "SummaryBuilder",
    "load_jsonl",
    "render_html",
    "render_markdown",
    "render_text",
    "summarize",
]


def summarize(record: Record, work: float | None = None, unit: str = "units") -> RunSummary:
    """Fold all rows of ``record`` into a :class:`RunSummary`."""
    builder = SummaryBuilder(gpu_names=record.gpu_names, mem_total_gb=record.mem_total_gb)
    for row in record.rows:
        builder.add(row.step, row.time, row.values)
    return builder.result(work=work, unit=unit)


def render_markdown(record: Record, summary: RunSummary, title: str | None = None) -> str:
    """Markdown for a pull-request comment: headline, per-GPU table, sparklines by step."""
    if not record.trained:
        summary = dataclasses.replace(summary, steps=None, first_step=None, last_step=None,
                                      energy_per_step_j=None, step_time_mean_s=None)
    text = render_markdown_summary(summary, title or f"gpulens report: {record.path.name}")
    lines = []
    for key, label in (("train/loss", "loss"), ("perf/step_time_s", "step time")):
        if not record.trained:
            break
        vals = [r.values[key] for r in record.rows if key in r.values]
        if vals:
            lines.append(
                f"| {label} | `{sparkline(vals)}` | {min(vals):.4g} to {max(vals):.4g} |"
            )
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
    if record.skipped:
        text += f"\n_{record.skipped} malformed line(s) skipped._\n"
    return text
