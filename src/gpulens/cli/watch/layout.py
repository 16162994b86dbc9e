"""The frame of the live view: which columns fit the terminal (:func:`layout`), each GPU's cells,
the title and footer, and the whole frame as ``rich`` lines (:func:`render_lines`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gpulens.cli.watch.processes import PROCESS_MIN_WIDTH, process_lines
from gpulens.cli.watch.training import training_lines
from gpulens.cli.watch.view import GpuView, num, short_name
from gpulens.report.tail import TrainingStatus
from gpulens.report.text import gib, sparkline
from gpulens.sources.processes import GpuProcess


def _bar(value: float | None, total: float | None, width: int = 12) -> str:
    if value is None or not total:
        return " " * width
    filled = max(0, min(width, round(value / total * width)))
    return "█" * filled + "░" * (width - filled)


@dataclass(frozen=True)
class Column:
    """One column of the live view.

    Core columns are always shown (together they fit 80 columns); the others join, in the
    order of :data:`OPTIONAL`, while the terminal has room, and the flexible ones (``grow``)
    then share what is left.
    """

    key: str
    header: str
    width: int
    """Minimum width in cells (content may make it wider)."""
    grow: int = 0
    """How many cells more it takes when the terminal has them."""
    right: bool = True


COLUMNS: dict[str, Column] = {c.key: c for c in (
    Column("gpu", "GPU", 3),
    Column("name", "Name", 4, right=False),
    Column("activity", "Activity", 8),
    Column("history", "History", 12, grow=1 << 30, right=False),
    Column("tensor", "Tensor", 6),
    Column("dram", "DRAM bw", 7),
    Column("memory", "Memory", 12),
    Column("mem_bar", "Mem used", 11, right=False),
    Column("power", "Power", 9),
    Column("power_bar", "Of limit", 11, right=False),
    Column("temp", "Temp", 4),
    Column("clock", "SM clock", 8),
    Column("held", "Held by", 9, right=False),
)}


ORDER = ("gpu", "name", "activity", "history", "tensor", "dram", "memory", "mem_bar", "power",
         "power_bar", "temp", "clock", "held")
"""Left to right on a line."""


CORE = ("gpu", "activity", "tensor", "memory", "power", "temp", "clock", "held")
"""Always shown: GPU, activity, tensor, memory, power, temperature, clock, what holds it down.
With everyday figures they take 73 cells: an 80-column terminal shows them all."""


OPTIONAL = ("history", "mem_bar", "power_bar", "dram", "name")
"""Added as the terminal widens, in this order (the GPU model comes first when the GPUs are
not all the same model; otherwise the title names it).  The history then grows to
``--history`` cells."""


GAP = 2


def layout(width: int, history: int, cells: dict[str, list[str]] | None = None,
           mixed_models: bool = False) -> dict[str, int]:
    """Column key -> width for a terminal ``width`` cells wide.  ``cells`` holds the texts to
    show: a column is never narrower than its widest text, so no figure is ever cut."""

    def need(key: str) -> int:
        col = COLUMNS[key]
        content = max((len(t) for t in (cells or {}).get(key, [])), default=0)
        return max(col.width, len(col.header), content)

    widths = {k: need(k) for k in CORE}
    used = sum(widths.values()) + GAP * (len(widths) - 1)
    optional = (("name", *(k for k in OPTIONAL if k != "name")) if mixed_models else OPTIONAL)
    for key in optional:
        w = min(need(key), history) if key == "history" else need(key)
        if used + GAP + w <= width:
            widths[key] = w
            used += GAP + w
    if "history" in widths:
        extra = max(0, min(history - widths["history"], width - used))
        widths["history"] += extra
    return widths


def _cells(v: GpuView, widths: dict[str, int]) -> dict[str, tuple[str, str]]:
    """Column key -> (text, style) for one GPU."""
    label, act = v.activity()
    used, total = v.get("mem_used_gb"), v.mem_total_gb()
    power, limit = v.get("power_w"), v.power_limit_w()
    temp = v.get("temp_c")
    mem_pct = None if used is None or not total else used / total * 100
    power_pct = None if power is None or not limit else power / limit * 100
    held = v.held_by()
    held = {"power cap+thermal": "pwr+therm"}.get(held, held)
    tensor, dram = v.get("tensor_active_pct"), v.get("dram_bw_pct")
    hist = list(v.history)[-widths.get("history", 1):]
    return {
        "gpu": (v.key, "bold"),
        "name": (short_name(v.info.name), ""),
        "activity": (f"{'SM' if label == 'SM' else 'util':<4}{num(act, '3.0f', '%'):>4}",
                     _level(act, 50, 85, reverse=True)),
        "history": (sparkline(hist, len(hist) or 1, 0.0, 100.0), "green"),
        "tensor": (num(tensor, ".0f", "%") if tensor is not None else "-", "cyan"),
        "dram": (num(dram, ".0f", "%") if dram is not None else "-", ""),
        "memory": (f"{num(used, '.1f')}/{num(total, '.1f')} GB", _level(mem_pct, 80, 95)),
        "mem_bar": (f"{_bar(used, total, 6)} {num(mem_pct, '3.0f', '%')}",
                    _level(mem_pct, 80, 95)),
        "power": (f"{num(power, '.0f')}/{num(limit, '.0f')} W", _level(power_pct, 90, 98)),
        "power_bar": (f"{_bar(power, limit, 6)} {num(power_pct, '3.0f', '%')}",
                      _level(power_pct, 90, 98)),
        "temp": (num(temp, ".0f", "°C"), _level(temp, 80, 87)),
        "clock": (num(v.get("sm_clock_mhz"), ".0f", " MHz"), ""),
        "held": (held, "yellow" if held not in ("-", "n/a") else "dim"),
    }


def _pad(text: str, width: int, right: bool) -> str:
    return text.rjust(width) if right else text.ljust(width)


def render_lines(views: list[GpuView], width: int, history: int, interval: float,
                 hostname: str, backend: str, host: dict[str, float] | None = None,
                 training: TrainingStatus | None = None,
                 now: float | None = None, processes: list[GpuProcess] | None = None,
                 height: int | None = None) -> list[Any]:
    """The frame as ``rich.text.Text`` lines, none wider than ``width`` cells; ``training``
    (``--record``) adds the training's lines under the GPUs, and ``processes`` (at least
    :data:`PROCESS_MIN_WIDTH` wide) the process table, in what ``height`` lines leave."""
    from rich.text import Text

    probe = {k: [t for t, _ in (_cells(v, {"history": history})[k] for v in views)]
             for k in ORDER if k != "history"}
    models = sorted({short_name(v.info.name) for v in views})
    widths = layout(width, history, probe, mixed_models=len(models) > 1)
    keys = [k for k in ORDER if k in widths]
    lines = [_title(views, models, width, interval, hostname, backend)]
    header = Text(no_wrap=True, overflow="crop", style="bold")
    header.append((" " * GAP).join(_pad(COLUMNS[k].header, widths[k], COLUMNS[k].right)
                                   for k in keys))
    lines.append(header)
    rule_width = min(width, sum(widths[k] for k in keys) + GAP * (len(keys) - 1))
    lines.append(Text("─" * rule_width, style="dim"))
    for v in views:
        line = Text(no_wrap=True, overflow="crop")
        cells = _cells(v, widths)
        for i, k in enumerate(keys):
            if i:
                line.append(" " * GAP)
            text, style = cells[k]
            line.append(_pad(text, widths[k], COLUMNS[k].right), style=style)
        lines.append(line)
    lines.append(Text(""))
    if training is not None:
        lines.extend(training_lines(training, width, time.time() if now is None else now))
    footer = _footer(views, width, host)
    if processes is not None and width >= PROCESS_MIN_WIDTH:
        rows = (height - len(lines) - len(footer) - 1 if height is not None
                else len(processes) + 3)
        table = process_lines(processes, width, rows, rule_width)
        if table:
            lines.extend(table)
            lines.append(Text(""))
    lines.extend(footer)
    return lines


def _title(views: list[GpuView], models: list[str], width: int, interval: float,
           hostname: str, backend: str) -> Any:
    """``gpulens watch · SIMULATED GPUs · host · 8 x H100 80GB HBM3 · every 1 s``, leaving out
    from the end what does not fit."""
    from rich.text import Text

    parts: list[tuple[str, str]] = [("gpulens watch", "bold")]
    if backend == "simulated":
        parts.append(("SIMULATED GPUs", "bold black on yellow"))
    elif backend != "nvml":
        parts.append((f"backend {backend}", "bold"))
    parts.append((hostname, ""))
    parts.append((f"{len(views)} x {models[0]}" if len(models) == 1
                  else f"{len(views)} GPUs", ""))
    parts.append((f"every {interval:g} s", ""))
    while len(parts) > 1 and len(" · ".join(t for t, _ in parts)) > width:
        parts.pop()
    title = Text(no_wrap=True, overflow="crop")
    for i, (text, style) in enumerate(parts):
        if i:
            title.append(" · ")
        title.append(text, style=style)
    return title


def _footer(views: list[GpuView], width: int, host: dict[str, float] | None) -> list[Any]:
    """Units (GB vs GiB, what activity means), the host, and how to quit; as many lines as
    the width needs."""
    from rich.text import Text

    total = next((t for v in views if (t := v.mem_total_gb())), None)
    pieces = ["q quits"]
    if total:
        pieces.append(f"GB = 10⁹ bytes: {total:.1f} GB = {gib(total):.1f} GiB")
    labels = {v.activity()[0] for v in views}
    if "SM" in labels:
        pieces.append("SM = GPM SM active")
    if "util" in labels:
        pieces.append("util = NVML utilization")
    if any(v.get("tensor_active_pct") is not None for v in views):
        pieces.append("Tensor = tensor-core active")
    if host:
        cpu, ram = host.get("host/cpu_pct"), host.get("host/ram_used_gb")
        if cpu is not None or ram is not None:
            pieces.append(f"host CPU {num(cpu, '.0f', '%')} RAM {num(ram, '.1f')} GB")
    out: list[Any] = []
    current = ""
    for piece in pieces:
        candidate = piece if not current else f"{current} · {piece}"
        if len(candidate) <= width or not current:
            current = candidate
        else:
            out.append(Text(current, style="dim", no_wrap=True, overflow="crop"))
            current = piece
    out.append(Text(current, style="dim", no_wrap=True, overflow="crop"))
    return out


def render(views: list[GpuView], interval: float, hostname: str, backend: str,
           width: int = 80, history: int = 30, host: dict[str, float] | None = None,
           training: TrainingStatus | None = None, processes: list[GpuProcess] | None = None,
           height: int | None = None) -> Any:
    """The rich renderable for one frame, laid out for ``width`` columns (and ``height``
    lines, which bound the process table)."""
    from rich.console import Group

    return Group(*render_lines(views, width, history, interval, hostname, backend, host,
                               training, processes=processes, height=height))


def _level(value: float | None, warn: float, bad: float, reverse: bool = False) -> str:
    if value is None:
        return "dim"
    if reverse:
        return "green" if value >= bad else "yellow" if value >= warn else "red"
    return "red" if value >= bad else "yellow" if value >= warn else "default"
