"""The report of a sweep, for a person to act on: what to use, how much faster it is than the
current setting, the numbers behind it, the out-of-memory edge and the memory headroom.

* :func:`headline` — the few sentences that say it (every format starts with them);
* :func:`render_text` — plain text (table + a bar chart of throughput by batch size, one bar
  per worker count), for logs and the Markdown code block;
* :func:`print_report` — the same in a terminal, with rich when it is installed;
* :func:`render_markdown` — bullet points, the table and the text chart;
* :func:`render_html` — one self-contained page: the headline, throughput against batch size
  (one line per worker count, the out-of-memory edge and the choice marked), data wait and
  peak memory against batch size (charts from :mod:`gpulens.report.svg`), the table.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

from gpulens.report.svg import Series, color, fmt, line_chart
from gpulens.tune.model import Trial, TuneResult
from gpulens.tune.progress import seconds_text

NA = "-"
"""A figure that was not measured."""

COLUMNS = ("#", "why", "batch", "accum", "workers", "loader", "samples/s", "tokens/s",
           "vs chosen", "data wait %", "fwd+bwd %", "optim %", "step ms", "MFU %", "peak GB",
           "headroom GB", "retries", "status")


def _num(v: float | None, digits: int = 1) -> str:
    return NA if v is None else f"{v:.{digits}f}"


def _rate(v: float | None) -> str:
    return NA if v is None else fmt(v)


def _loader_cell(t: Trial) -> str:
    c = t.config
    parts = []
    if c.pin_memory is not None:
        parts.append("pinned" if c.pin_memory else "not pinned")
    if c.prefetch_factor is not None:
        parts.append(f"prefetch {c.prefetch_factor}")
    return ", ".join(parts) or NA


def rows(result: TuneResult) -> list[tuple[str, ...]]:
    """The table's cells (:data:`COLUMNS`), one row per trial in the order they ran."""
    chosen = result.chosen
    out: list[tuple[str, ...]] = []
    for i, t in enumerate(result.trials, 1):
        c = t.config
        vs = (NA if chosen is None or not t.ok else
              f"{100 * (t.throughput / chosen.throughput - 1):+.1f} %")
        status = t.status + (" (chosen)" if t is chosen else "")
        out.append((str(i), t.role, str(c.batch_size), str(c.accumulation), str(c.num_workers),
                    _loader_cell(t), _rate(t.samples_per_s), _rate(t.tokens_per_s), vs,
                    _num(t.data_wait_pct), _num(t.forward_backward_pct),
                    _num(t.optimizer_pct),
                    _num(None if t.step_s is None else 1000 * t.step_s),
                    _num(t.mfu_pct), _num(t.peak_reserved_gb), _num(t.headroom_gb),
                    NA if t.alloc_retries is None else str(t.alloc_retries), status))
    return out


TERMINAL = frozenset(COLUMNS) - {"fwd+bwd %", "optim %", "step ms", "headroom GB"}
"""The columns that fit a terminal (the files have them all)."""


def table(result: TuneResult, columns: frozenset[str] = frozenset(COLUMNS),
          ) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """``(columns, rows)`` of ``columns``, without those that say nothing here (every cell
    ``-``, or an accumulation of 1 throughout)."""
    cells = rows(result)
    keep = [i for i, h in enumerate(COLUMNS) if h in columns
            and not all(r[i] in (NA, "1" if h == "accum" else NA) for r in cells)]
    return (tuple(COLUMNS[i] for i in keep),
            [tuple(r[i] for i in keep) for r in cells])


def headline(result: TuneResult) -> list[str]:
    """The sentences a person acts on."""
    s = result.settings
    lines: list[str] = []
    c = result.chosen
    if c is None:
        lines.append("No configuration could be timed: " + (
            "every one ran out of memory." if result.oom_batch is not None
            else "interrupted first." if result.stopped == "interrupted"
            else "see the trials below."))
    else:
        figs = [f"{fmt(c.throughput)} samples/s"]
        if c.tokens_per_s is not None:
            figs.append(f"{fmt(c.tokens_per_s)} tokens/s")
        if c.mfu_pct is not None:
            figs.append(f"MFU {c.mfu_pct:.1f} %")
        line = f"Use {c.config.label()}: {', '.join(figs)}"
        cur = result.current
        if result.stopped == "interrupted":  # a partial sweep: what ran, not a choice
            line = (f"Fastest of the {len(result.trials)} trial(s) that finished before the "
                    f"interrupt: {c.config.label()}: {', '.join(figs)}")
        elif cur is not None and (cur is c or cur.config == c.config):
            line = (f"Keep the current setting, {c.config.label()}: {', '.join(figs)}, the "
                    "fastest measured")
        elif result.speedup_pct is not None and cur is not None:
            line += (f", {result.speedup_pct:+.1f} % against the current setting "
                     f"({cur.config.label()}: {fmt(cur.throughput)} samples/s)")
        elif cur is not None and cur.status == "oom":
            line += f"; the current setting ({cur.config.label()}) runs out of memory"
        lines.append(line + ".")
        if c.data_wait_pct is not None:
            under = "under" if c.data_wait_pct < s.data_wait_pct else "not under"
            lines.append(f"Data wait at that setting: {c.data_wait_pct:.1f} % of the step "
                         f"({under} the {s.data_wait_pct:g} % target).")
    paced = sum(t.data_wait_by == "loader pace" for t in result.trials)
    if paced:
        lines.append(f"{paced} trial(s) waited less for data in their timed steps than their "
                     "loader workers' pace allows (batches queued during the warm-up, or a "
                     "window too short to show it): their data wait is the workers' pace.")
    if result.oom_batch is not None:
        fits = f" (the largest that ran: {result.fits_batch})" if result.fits_batch else ""
        lines.append(f"Out of memory from batch {result.oom_batch}{fits}; recorded, the sweep "
                     "went on.")
    elif result.fits_batch is not None:
        lines.append(f"No out-of-memory error up to batch {result.fits_batch}.")
    if c is not None and c.peak_reserved_gb is not None and c.total_gb is not None:
        headroom = c.headroom_gb if c.headroom_gb is not None else \
            c.total_gb - c.peak_reserved_gb
        retries = "" if c.alloc_retries is None else f", {c.alloc_retries} allocator retries"
        lines.append(f"Memory at the chosen setting: peak {c.peak_reserved_gb:.1f} GB reserved "
                     f"of {c.total_gb:.1f} GB on the fullest GPU ({headroom:.1f} GB "
                     f"headroom){retries}.")
    if result.confirm is not None and result.confirm_diff_pct is not None:
        lines.append(f"Measured again at the end: {fmt(result.confirm.throughput)} samples/s "
                     f"({result.confirm_diff_pct:+.1f} % from the first measurement).")
    stop = "" if result.stopped == "done" else f", stopped early: {result.stopped}"
    ranks = f" on {result.world_size} ranks (slowest rank, fullest GPU)" \
        if result.world_size > 1 else ""
    lines.append(f"{len(result.trials)} trials in {seconds_text(result.elapsed_s)}{ranks} on "
                 f"{result.device or 'an unknown device'}{stop}.")
    lines.extend(n[0].upper() + n[1:] + "." for n in result.notes)
    return lines


def _series_by_workers(result: TuneResult) -> dict[int, list[Trial]]:
    """The plain-loader trials (no pin/prefetch change) by worker count, best per batch."""
    best: dict[tuple[int, int], Trial] = {}
    for t in result.trials:
        c = t.config
        if t.role == "confirm" or c.pin_memory is not None or c.prefetch_factor is not None:
            continue
        key = (c.num_workers, c.batch_size)
        if key not in best or t.throughput > best[key].throughput:
            best[key] = t
    out: dict[int, list[Trial]] = {}
    for (w, _b), t in sorted(best.items()):
        out.setdefault(w, []).append(t)
    return out


def text_chart(result: TuneResult, width: int = 36) -> str:
    """Throughput by batch size, one bar per worker count measured at it."""
    ok = [t for t in result.trials if t.ok]
    top = max((t.throughput for t in ok), default=0.0)
    by_batch: dict[int, list[Trial]] = {}
    for trials in _series_by_workers(result).values():
        for t in trials:
            by_batch.setdefault(t.config.batch_size, []).append(t)
    lines = ["samples/s by batch size (one bar per worker count; * = chosen)"]
    for b in sorted(by_batch):
        for i, t in enumerate(sorted(by_batch[b], key=lambda t: t.config.num_workers)):
            head = f"batch {b:>5}" if i == 0 else " " * 11
            mark = "*" if result.chosen is not None and t.config == result.chosen.config else " "
            if not t.ok:
                bar = "out of memory" if t.status == "oom" else "not timed"
                lines.append(f"{head} | w{t.config.num_workers:<2} {bar}")
                continue
            n = 0 if top <= 0 else t.throughput / top * width
            bar = "#" * int(n) + ("+" if n - int(n) >= 0.5 else "")
            lines.append(f"{head} | w{t.config.num_workers:<2}{mark}{bar:<{width + 1}} "
                         f"{fmt(t.throughput)}")
    return "\n".join(lines)


def _table_text(result: TuneResult) -> str:
    heads, cells = table(result)
    widths = [max(len(r[i]) for r in (heads, *cells)) for i in range(len(heads))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def render_text(result: TuneResult, title: str = "gpulens tune") -> str:
    """Plain text: the headline, the table, the bar chart."""
    return "\n".join([title, "", *headline(result), "", _table_text(result), "",
                      text_chart(result), ""])


def print_report(result: TuneResult, title: str = "gpulens tune", file: Any = None) -> None:
    """The report in a terminal (rich when installed, else :func:`render_text`)."""
    import sys

    out = file or sys.stdout
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(render_text(result, title), file=out)
        return
    console = Console(file=out, highlight=False)
    console.print(f"[bold]{escape(title)}[/bold]")
    for line in headline(result):
        console.print(f"  {line}", markup=False, soft_wrap=True)
    heads, cells = table(result, TERMINAL)
    grid = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for h in heads:
        grid.add_column(h, justify="left" if h in ("why", "loader", "status") else "right")
    for r, t in zip(cells, result.trials, strict=True):
        style = "bold" if t is result.chosen else ("red" if t.status == "oom" else None)
        grid.add_row(*r, style=style)
    console.print(grid)
    console.print(text_chart(result), markup=False)


def render_markdown(result: TuneResult, title: str = "gpulens tune") -> str:
    """Markdown: the headline as bullets, the table, the text chart in a code block."""
    heads, cells = table(result)
    head = "| " + " | ".join(heads) + " |\n|" + "---|" * len(heads)
    body = "\n".join("| " + " | ".join(r) + " |" for r in cells)
    bullets = "\n".join(f"- {line}" for line in headline(result))
    return (f"## {title}\n\n{bullets}\n\n{head}\n{body}\n\n```\n{text_chart(result)}\n```\n")


def _charts(result: TuneResult) -> list[str]:
    by_w = _series_by_workers(result)
    sizes = sorted({t.config.batch_size for t in result.trials})
    if not sizes:
        return []
    xs = [math.log2(b) for b in sizes]
    xr = (min(xs) - 0.25, max(xs) + 0.25)
    ticks = [(math.log2(b), str(b)) for b in sizes if b & (b - 1) == 0 or len(sizes) < 8]

    def lines(key: str) -> list[Series]:
        out = []
        for i, (w, trials) in enumerate(sorted(by_w.items())):
            pts = [(math.log2(t.config.batch_size), float(getattr(t, key))) for t in trials
                   if t.ok and getattr(t, key) is not None]
            out.append(Series(f"{w} worker{'s' if w != 1 else ''}", pts, color(i)))
        return out

    def vline(x_batch: int | None, top: float, label: str, col: str) -> list[Series]:
        if x_batch is None:
            return []
        x = math.log2(x_batch)
        return [Series(label, [(x, 0.0), (x, top)], col, dash="4 3", width=1.2, hover=False)]

    def chart(cid: str, title: str, unit: str, series: list[Series], extra: list[Series],
              ceiling: float | None = None) -> str:
        return line_chart(cid, title, unit, series + extra, xr, y_floor=0.0,
                          y_ceiling=ceiling, x_label="batch size", y_label=unit,
                          x_ticks=ticks, x_log2=True)

    thr = lines("samples_per_s")
    top = max((p[1] for s in thr for p in s.points), default=1.0)
    extra = vline(result.oom_batch, top, f"out of memory from {result.oom_batch}", "#b91c1c")
    if result.chosen is not None:
        c = result.chosen
        extra.append(Series(f"chosen: {c.config.label()}", [(math.log2(c.config.batch_size),
                                                             c.throughput)], "#111827",
                            hover=False))
    out = [chart("tune-throughput", "Throughput by batch size", "samples/s", thr, extra)]
    target = result.settings.data_wait_pct
    wait = lines("data_wait_pct")
    if any(s.points for s in wait):
        line = [Series(f"{target:g} % target", [(xr[0], target), (xr[1], target)], "#64748b",
                       dash="4 3", width=1.2, hover=False)]
        out.append(chart("tune-data-wait", "Data wait by batch size", "%", wait, line))
    mem = lines("peak_reserved_gb")
    if any(s.points for s in mem):
        totals = [t.total_gb for t in result.trials if t.total_gb is not None]
        line = [Series(f"GPU memory {max(totals):.0f} GB", [(xr[0], max(totals)),
                                                              (xr[1], max(totals))],
                       "#b91c1c", dash="4 3", width=1.2, hover=False)] if totals else []
        out.append(chart("tune-memory", "Peak memory (reserved) by batch size", "GB", mem,
                         line))
    return out


def render_html(result: TuneResult, title: str = "gpulens tune") -> str:
    """One self-contained HTML page (no network needed to view it)."""
    from gpulens.report.html import CSS, SCRIPT

    chosen = result.chosen
    heads, cells = table(result)
    head = "".join(f"<th>{escape(h)}</th>" for h in heads)
    body = []
    for r, t in zip(cells, result.trials, strict=True):
        cls = ' class="chosen"' if t is chosen else (' class="critical"' if t.status == "oom"
                                                     else "")
        body.append(f"<tr{cls}>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>")
    bullets = "".join(f"<li>{escape(line)}</li>" for line in headline(result))
    charts = "".join(_charts(result))
    return (
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body><main>"
        f"<h1>{escape(title)}</h1><ul id=\"headline\">{bullets}</ul>"
        f'<h2>By batch size</h2><div class="grid2">{charts}</div>'
        f'<h2>Trials</h2><div class="scroll"><table id="trials"><tr>{head}</tr>'
        f"{''.join(body)}</table></div>"
        "<p class=note>Each trial ran warm-up steps, then a timed window of "
        f"{result.settings.steps} optimizer steps (or {result.settings.max_trial_s} s) with the "
        "device synchronised at its two ends; phases are shares of the step time, timed with "
        "CUDA events on a GPU. Rates are of the whole job; under DDP the slowest rank's times "
        "the ranks. Memory is in GB of 10^9 bytes.</p>"
        '<div id="js-errors" hidden></div><div id="tip" hidden></div>'
        f"</main><script>{SCRIPT}</script></body></html>"
    )
