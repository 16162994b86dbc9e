"""``gpulens watch [--gpus 0,1] [--interval S]``: a live terminal view.

One line per GPU, readable in an 80x24 terminal: activity (GPM SM active where the GPU has
GPM, else NVML utilization), tensor-core activity, memory used/total, power against its limit,
temperature, SM clock, and what holds the clocks down (power cap, thermal).  As the terminal
widens, more columns join: the activity history (a sparkline of the last ``--history``
intervals), the GPU model, memory and power bars, DRAM bandwidth; from 100 columns on, a table
of the processes on the GPUs (GPU, process id, user, GPU memory held, command line), as many
rows as the terminal's height leaves.  The view follows the terminal's size while it runs.
``q`` quits.  Without a terminal (or with ``--plain``) it prints one plain line per interval
(and, once, on stderr, what the GPUs are).

Memory is in GB of 1e9 bytes, as NVML counts it: an "80GB" card shows 85.9 GB (80.0 GiB);
the view says so.  The figures are the newest samples (``Monitor.latest()``), read every
``--interval`` seconds.

``--record PATH`` also follows a training's JSONL record (the ``jsonl`` sink's file, which
the training's own gpulens writes; the file may not exist yet) and shows, under the GPU
lines, its latest step: loss, throughput (tokens/s, else samples/s), MFU (else achieved
TFLOP/s per GPU) and how long ago the row was written, then the advice rules firing in that
row (``alerts/<rule>``) with the step each started, and what to try for the newest one.  At 80
columns the lower-priority figures (clock-adjusted MFU, TFLOP/s, tokens per joule) are left
out before anything is cut.  The watch itself has no training loop: its own rows would have no
work, so throughput and MFU come only from the record.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from gpulens.cli._common import CliError, monitor_interval
from gpulens.report.tail import RecordTail, TrainingStatus
from gpulens.report.text import gib, sized, sparkline
from gpulens.sinks.base import GpuInfo
from gpulens.sources.processes import GpuProcess


@dataclass
class GpuView:
    """What one line of the view shows, in the row keys' units."""

    info: GpuInfo
    history: deque[float]
    values: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return str(self.info.index)

    def get(self, suffix: str) -> float | None:
        return self.values.get(suffix)

    def activity(self) -> tuple[str, float | None]:
        """(label, percent): GPM SM active where present, else NVML utilization."""
        sm = self.get("sm_active_pct")
        if sm is not None:
            return "SM", sm
        return "util", self.get("util_pct")

    def held_by(self) -> str:
        """``"power cap"``, ``"thermal"``, ``"power cap+thermal"``, ``"other"``, ``"-"``."""
        reasons = [name for suffix, name in (("throttle_power_pct", "power cap"),
                                             ("throttle_thermal_pct", "thermal"))
                   if (self.get(suffix) or 0) > 0]
        if reasons:
            return "+".join(reasons)
        if (self.get("throttle_pct") or 0) > 0:
            return "other"
        return "-" if self.get("throttle_pct") is not None else "n/a"

    def mem_total_gb(self) -> float | None:
        if self.info.mem_total_gb:
            return self.info.mem_total_gb
        used, pct = self.get("mem_used_gb"), self.get("mem_pct")
        return used / pct * 100 if used is not None and pct else None

    def power_limit_w(self) -> float | None:
        return self.get("power_limit_w") or self.info.power_limit_w


def _f(v: float | None, fmt: str, unit: str = "") -> str:
    return "n/a" if v is None else f"{v:{fmt}}{unit}"


def plain_line(views: list[GpuView]) -> str:
    """One line for all GPUs, for logs and pipes."""
    parts = [time.strftime("%H:%M:%S")]
    for v in views:
        label, act = v.activity()
        tensor = v.get("tensor_active_pct")
        parts.append(
            f"gpu{v.key} {label} {_f(act, '.0f', '%')}"
            + (f" tensor {tensor:.0f}%" if tensor is not None else "")
            + f" mem {_f(v.get('mem_used_gb'), '.1f')}/{_f(v.mem_total_gb(), '.1f')} GB"
            + f" power {_f(v.get('power_w'), '.0f')}/{_f(v.power_limit_w(), '.0f')} W"
            + f" temp {_f(v.get('temp_c'), '.0f')} C"
            + f" sm {_f(v.get('sm_clock_mhz'), '.0f')} MHz"
            + f" held {v.held_by()}"
        )
    return " | ".join(parts)


def rate(v: float) -> str:
    """A rate in few characters: ``"9,876"``, ``"163k"``, ``"1.63M"``."""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    if a >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def _ago(status: TrainingStatus, now: float) -> str:
    if status.ended:
        return "run ended"
    if status.time is None:
        return ""
    age = max(0.0, now - status.time)
    return f"{age:.0f} s ago" if age < 120 else f"{age / 60:.0f} min ago"


def training_pieces(status: TrainingStatus, now: float) -> list[tuple[int, str]]:
    """``(priority, text)`` of the training line, in display order; 0 is kept longest."""
    v = status.values
    out: list[tuple[int, str]] = [(0, f"step {status.step:,}")]
    if "train/loss" in v:
        out.append((1, f"loss {v['train/loss']:.4g}"))
    if "perf/tokens_per_s" in v:
        out.append((2, f"{rate(v['perf/tokens_per_s'])} tok/s"))
    elif "perf/samples_per_s" in v:
        out.append((2, f"{rate(v['perf/samples_per_s'])} samples/s"))
    if "perf/mfu_pct" in v:
        out.append((3, f"MFU {sized(v['perf/mfu_pct'])}%"))
        if "perf/mfu_clock_adjusted_pct" in v:
            out.append((6, f"clock-adj. {sized(v['perf/mfu_clock_adjusted_pct'])}%"))
        if "perf/tflops" in v:
            out.append((5, f"{sized(v['perf/tflops'])} TFLOP/s/GPU"))
    elif "perf/tflops" in v:
        out.append((3, f"{sized(v['perf/tflops'])} TFLOP/s/GPU"))
    if "perf/tokens_per_j" in v:
        out.append((7, f"{rate(v['perf/tokens_per_j'])} tok/J"))
    ago = _ago(status, now)
    if ago:
        out.append((4, ago))
    return out


def training_text(status: TrainingStatus, width: int, now: float) -> str:
    """The training line, at most ``width`` cells: pieces of lower priority leave first."""
    head = "Training"
    if status.error or not status.exists:
        for where in (str(status.path), status.path.name):  # the name alone where too long
            text = (f"{head}: cannot read {where}: {status.error}" if status.error
                    else f"{head}: waiting for {where} (not written yet)")
            if len(text) <= width:
                break
        return text
    if status.step is None:
        return f"{head}: {'run ' + status.run_id if status.run_id else status.path.name}, " \
               "no step yet"
    pieces = training_pieces(status, now)
    while True:
        text = head + "  " + " · ".join(t for _, t in pieces)
        if len(text) <= width or len(pieces) == 1:
            return text
        pieces.remove(max(pieces, key=lambda p: p[0]))


def alerts_text(status: TrainingStatus, width: int) -> tuple[str, bool]:
    """``("Alerts firing: input_bound (step 26)", True)``, or ``("Alerts: none firing",
    False)``, at most ``width`` cells (the steps, then names, leave before it is cut)."""
    if status.step is None:
        return "", False
    firing = status.firing
    if not firing:
        judged = any(k.startswith("alerts/") for k in status.values)
        return ("Alerts: none firing" if judged else "Alerts: no rule has judged yet"), False
    named = []
    for rule in firing:
        at = status.fired_at(rule)
        named.append((rule, f"{rule} (step {at})" if at is not None and at >= 0 else rule))
    for with_step in (True, False):
        shown = [text if with_step else rule for rule, text in named]
        for n in range(len(shown), 0, -1):
            more = f", +{len(shown) - n} more" if n < len(shown) else ""
            text = "Alerts firing: " + ", ".join(shown[:n]) + more
            if len(text) <= width:
                return text, True
    return f"Alerts firing: {len(firing)}", True


def advice_text(status: TrainingStatus, width: int) -> str:
    """What to try for the newest rule that fired and still fires, cut at a word boundary
    within ``width`` cells; ``""`` when there is none."""
    firing = set(status.firing)
    for e in reversed(status.events):
        if e.state == "firing" and e.name in firing and e.advice:
            text = f"  try ({e.name}): {e.advice}"
            if len(text) <= width:
                return text
            cut = text.rfind(" ", 0, width)
            return text[:cut if cut > 0 else width].rstrip(" ,;:")
    return ""


def plain_training(status: TrainingStatus, now: float) -> str:
    """The record's latest step on one line, for ``--plain``."""
    if status.error or not status.exists or status.step is None:
        return training_text(status, 10_000, now).replace("Training: ", "train: ")
    v = status.values
    parts = [f"train step {status.step}"]
    for key, label, fmt in (("train/loss", "loss", ".4g"), ("perf/tokens_per_s", "tok/s", ".0f"),
                            ("perf/samples_per_s", "samples/s", ".4g"),
                            ("perf/mfu_pct", "MFU", ""), ("perf/tflops", "TFLOP/s/GPU", "")):
        if key in v:
            text = format(v[key], fmt) if fmt else sized(v[key])
            parts.append(f"{label} {text}" + ("%" if label == "MFU" else ""))
    firing = status.firing
    parts.append("alerts " + (",".join(firing) if firing else "-"))
    if status.ended:
        parts.append("run ended")
    return " ".join(parts)


def _bar(value: float | None, total: float | None, width: int = 12) -> str:
    if value is None or not total:
        return " " * width
    filled = max(0, min(width, round(value / total * width)))
    return "█" * filled + "░" * (width - filled)


def short_name(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"H100 80GB HBM3"`` (the vendor says nothing here)."""
    return name[len("NVIDIA "):] if name.startswith("NVIDIA ") else name


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
        "activity": (f"{'SM' if label == 'SM' else 'util':<4}{_f(act, '3.0f', '%'):>4}",
                     _level(act, 50, 85, reverse=True)),
        "history": (sparkline(hist, len(hist) or 1, 0.0, 100.0), "green"),
        "tensor": (_f(tensor, ".0f", "%") if tensor is not None else "-", "cyan"),
        "dram": (_f(dram, ".0f", "%") if dram is not None else "-", ""),
        "memory": (f"{_f(used, '.1f')}/{_f(total, '.1f')} GB", _level(mem_pct, 80, 95)),
        "mem_bar": (f"{_bar(used, total, 6)} {_f(mem_pct, '3.0f', '%')}",
                    _level(mem_pct, 80, 95)),
        "power": (f"{_f(power, '.0f')}/{_f(limit, '.0f')} W", _level(power_pct, 90, 98)),
        "power_bar": (f"{_bar(power, limit, 6)} {_f(power_pct, '3.0f', '%')}",
                      _level(power_pct, 90, 98)),
        "temp": (_f(temp, ".0f", "°C"), _level(temp, 80, 87)),
        "clock": (_f(v.get("sm_clock_mhz"), ".0f", " MHz"), ""),
        "held": (held, "yellow" if held not in ("-", "n/a") else "dim"),
    }


def _pad(text: str, width: int, right: bool) -> str:
    return text.rjust(width) if right else text.ljust(width)


PROCESS_MIN_WIDTH = 100
"""From this many columns the view has a process table (and only then asks for processes)."""


def _command(p: GpuProcess) -> str:
    """The command line with its program's directory left out (``python train.py``)."""
    if p.command:
        head, _, rest = p.command.partition(" ")
        return f"{os.path.basename(head)} {rest}".rstrip()
    if p.name:
        return p.name
    return "(not visible from here: another PID namespace)"


def process_lines(processes: list[GpuProcess], width: int, rows: int,
                  rule_width: int | None = None) -> list[Any]:
    """The process table in at most ``rows`` lines of ``width`` cells (``[]`` if fewer than
    three fit): a rule, a header, one line per process by GPU and then GPU memory (largest
    first), and ``+N more`` when they do not all fit.  Only the command line is ever cut."""
    from rich.text import Text

    if rows < 3:
        return []
    rule = Text(no_wrap=True, overflow="crop")
    rule.append("Processes ", style="bold")
    rule.append("─" * max(0, min(width, rule_width or width) - len("Processes ")), style="dim")
    if not processes:
        return [rule, Text("none on these GPUs", style="dim", no_wrap=True, overflow="crop")]
    ordered = sorted(processes, key=lambda p: (p.gpu, -(p.gpu_mem_gb or 0.0), p.pid))
    user_w = max(4, min(10, max(len(p.user or "?") for p in ordered)))
    pid_w = max(3, max(len(str(p.pid)) for p in ordered))
    head = f"{'GPU':>3}  {'PID':>{pid_w}}  {'User':<{user_w}}  {'GPU mem':>9}  Command"
    out = [rule, Text(head[:width], style="bold", no_wrap=True, overflow="crop")]
    room = rows - 2
    shown = ordered if len(ordered) <= room else ordered[:room - 1]
    for p in shown:
        user = (p.user or "?")[:user_w]
        mem = _f(p.gpu_mem_gb, ".1f", " GB")
        left = f"{p.gpu:>3}  {p.pid:>{pid_w}}  {user:<{user_w}}  {mem:>9}  "
        command = _command(p)
        if len(left) + len(command) > width:
            command = command[:max(0, width - len(left) - 1)] + "…"
        line = Text(no_wrap=True, overflow="crop")
        line.append(left)
        line.append(command, style="cyan" if p.command else "dim")
        out.append(line)
    if len(shown) < len(ordered):
        out.append(Text(f"+{len(ordered) - len(shown)} more processes (a taller terminal shows "
                        "them)", style="dim", no_wrap=True, overflow="crop"))
    return out


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
        lines.extend(_training_lines(training, width, time.time() if now is None else now))
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


def _training_lines(status: TrainingStatus, width: int, now: float) -> list[Any]:
    from rich.text import Text

    out = [Text(training_text(status, width, now), style="bold", no_wrap=True, overflow="crop")]
    alerts, firing = alerts_text(status, width)
    if alerts:
        out.append(Text(alerts, style="bold red" if firing else "green", no_wrap=True,
                        overflow="crop"))
    advice = advice_text(status, width)
    if advice:
        out.append(Text(advice, style="yellow", no_wrap=True, overflow="crop"))
    out.append(Text(""))
    return out


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
            pieces.append(f"host CPU {_f(cpu, '.0f', '%')} RAM {_f(ram, '.1f')} GB")
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


@contextlib.contextmanager
def _cbreak(fd: int) -> Iterator[None]:
    """Keys arrive one at a time without echo; Ctrl-C still interrupts."""
    import termios
    import tty

    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def run_watch(args: argparse.Namespace) -> int:
    """Show the view until ``q`` (terminal), a signal, or ``--count`` intervals."""
    if args.history < 2:
        raise CliError("--history must be at least 2")
    if args.count is not None and args.count < 1:
        raise CliError("--count must be at least 1")
    record = getattr(args, "record", None)
    tail = RecordTail(record) if record else None
    if tail is not None and tail.path.is_dir():
        raise CliError(f"--record {record} is a directory, not a JSONL record")
    import gpulens

    try:
        # no GPU is this command's error, not a warning about host-only rows
        monitor = gpulens.Monitor(gpus=args.gpus, interval=monitor_interval(args.interval),
                                  require_gpu=True)
        monitor.start()
    except (ValueError, ImportError, OSError) as e:
        raise CliError(str(e)) from None
    try:
        ctx = monitor.context
        assert ctx is not None and ctx.gpus
        views = [GpuView(info=g, history=deque(maxlen=args.history)) for g in ctx.gpus]
        stop = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        old = signal.signal(signal.SIGTERM, on_signal)
        try:
            tty = not args.plain and sys.stdin.isatty() and sys.stdout.isatty()
            if tty:
                _run_tty(monitor, views, args, ctx.hostname, ctx.backend, stop, tail)
            else:
                _run_plain(monitor, views, args, ctx.backend, stop, tail)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, old)
    finally:
        monitor.stop()
    return 0


def _update(monitor: Any, views: list[GpuView]) -> dict[str, float]:
    """Fetch the newest samples into ``views``; returns the host figures (``host/...``)."""
    latest: dict[str, float] = monitor.latest()
    for v in views:
        prefix = f"gpu/{v.key}/"
        v.values = {k[len(prefix):]: val for k, val in latest.items() if k.startswith(prefix)}
        _, act = v.activity()
        if act is not None:
            v.history.append(act)
    return {k: val for k, val in latest.items() if k.startswith("host/")}


def describe(views: list[GpuView], backend: str) -> str:
    """One line saying what is watched, for the plain mode's stderr."""
    gpus = ", ".join(f"{v.key}: {v.info.name}" for v in views)
    total = next((t for v in views if (t := v.mem_total_gb())), None)
    sim = " (SIMULATED GPUs)" if backend == "simulated" else ""
    units = (f"; memory in GB = 10^9 bytes ({total:.1f} GB = {gib(total):.1f} GiB)"
             if total else "")
    return f"gpulens watch: {len(views)} GPU(s) [{gpus}] via {backend}{sim}{units}"


def _run_plain(monitor: Any, views: list[GpuView], args: argparse.Namespace, backend: str,
               stop: threading.Event, tail: RecordTail | None = None) -> None:
    following = f"; following the training record {tail.path}" if tail is not None else ""
    print(describe(views, backend) + following, file=sys.stderr, flush=True)
    n = 0
    while not stop.wait(args.interval):
        _update(monitor, views)
        line = plain_line(views)
        if tail is not None:
            line += " | " + plain_training(tail.poll(), time.time())
        try:
            print(line, flush=True)
        except BrokenPipeError:  # `gpulens watch | head`
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return
        n += 1
        if args.count is not None and n >= args.count:
            return


def _run_tty(monitor: Any, views: list[GpuView], args: argparse.Namespace, hostname: str,
             backend: str, stop: threading.Event, tail: RecordTail | None = None) -> None:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    fd = sys.stdin.fileno()

    def fit() -> None:
        """Follow the terminal's real size (a stale COLUMNS variable must not win)."""
        with contextlib.suppress(OSError):
            size = os.get_terminal_size(sys.stdout.fileno())
            console.size = (size.columns, size.lines)

    time.sleep(min(args.interval, 0.3))  # a first sample for every metric
    host = _update(monitor, views)
    fit()

    def frame() -> Any:
        # the process table needs the width; narrower, the engine is not asked
        wide = console.size.width >= PROCESS_MIN_WIDTH
        processes = monitor.processes() if wide else None
        return render(views, args.interval, hostname, backend, width=console.size.width,
                      history=args.history, host=host,
                      training=tail.poll() if tail is not None else None,
                      processes=processes, height=console.size.height)

    n = 0
    with _cbreak(fd), Live(frame(), console=console, screen=True, auto_refresh=False) as live:
        live.refresh()
        deadline = time.monotonic() + args.interval
        while not stop.is_set():
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                keys = os.read(fd, 32)
                if not keys or b"q" in keys.lower():
                    return
                continue
            host = _update(monitor, views)
            fit()
            live.update(frame(), refresh=True)
            n += 1
            if args.count is not None and n >= args.count:
                return
            deadline = time.monotonic() + args.interval
