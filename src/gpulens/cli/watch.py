"""``gpulens watch [--gpus 0,1] [--interval S]``: a live terminal view.

Per GPU: true activity (GPM SM active and tensor active where the GPU has GPM, else NVML
utilization) with a sparkline of the last ``--history`` intervals, memory used/total, power
against its limit, temperature, SM clock, and what holds the clocks down (power cap, thermal).
``q`` quits.  Without a terminal (or with ``--plain``) it prints one plain line per interval.

The figures are the newest samples (``Monitor.latest()``), read every ``--interval`` seconds.
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
from gpulens.report.text import sparkline
from gpulens.sinks.base import GpuInfo


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


def _bar(value: float | None, total: float | None, width: int = 12) -> str:
    if value is None or not total:
        return " " * width
    filled = max(0, min(width, round(value / total * width)))
    return "█" * filled + "░" * (width - filled)


def render(views: list[GpuView], interval: float, hostname: str, backend: str) -> Any:
    """The rich renderable for one frame."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"gpulens watch · {hostname} · {backend} · every {interval:g} s",
                  title_justify="left", expand=False, header_style="bold")
    for col in ("GPU", "Activity", "History", "Memory", "Power", "Temp", "SM clock",
                "Held down by"):
        table.add_column(col, no_wrap=True)
    for v in views:
        label, act = v.activity()
        tensor = v.get("tensor_active_pct")
        act_text = Text(f"{_bar(act, 100, 10)} {_f(act, '5.1f', '%')} {label}",
                        style=_level(act, 50, 85, reverse=True))
        if tensor is not None:
            act_text.append(f"\n{_bar(tensor, 100, 10)} {tensor:5.1f}% tensor", style="cyan")
        used, total = v.get("mem_used_gb"), v.mem_total_gb()
        power, limit = v.get("power_w"), v.power_limit_w()
        temp = v.get("temp_c")
        held = v.held_by()
        table.add_row(
            Text(f"{v.key} {v.info.name}"),
            act_text,
            Text(sparkline(list(v.history), len(v.history) or 1, 0.0, 100.0), style="green"),
            Text(f"{_bar(used, total, 10)} {_f(used, '.1f')}/{_f(total, '.0f')} GB",
                 style=_level(None if used is None or not total else used / total * 100, 80,
                              95)),
            Text(f"{_bar(power, limit, 10)} {_f(power, '.0f')}/{_f(limit, '.0f')} W",
                 style=_level(None if power is None or not limit else power / limit * 100, 90,
                              98)),
            Text(_f(temp, ".0f", " °C"), style=_level(temp, 80, 87)),
            Text(_f(v.get("sm_clock_mhz"), ".0f", " MHz")),
            Text(held, style="yellow" if held not in ("-", "n/a") else "dim"),
        )
    from rich.console import Group

    return Group(table, Text("q quits", style="dim"))


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
    import gpulens

    try:
        monitor = gpulens.Monitor(gpus=args.gpus, interval=monitor_interval(args.interval))
        monitor.start()
    except (ValueError, ImportError, OSError) as e:
        raise CliError(str(e)) from None
    try:
        ctx = monitor.context
        assert ctx is not None
        if not ctx.gpus:
            raise CliError("no GPUs to watch (no NVIDIA driver answered; "
                           "GPULENS_BACKEND=simulated shows simulated GPUs)")
        views = [GpuView(info=g, history=deque(maxlen=args.history)) for g in ctx.gpus]
        stop = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        old = signal.signal(signal.SIGTERM, on_signal)
        try:
            tty = not args.plain and sys.stdin.isatty() and sys.stdout.isatty()
            if tty:
                _run_tty(monitor, views, args, ctx.hostname, ctx.backend, stop)
            else:
                _run_plain(monitor, views, args, stop)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, old)
    finally:
        monitor.stop()
    return 0


def _update(monitor: Any, views: list[GpuView]) -> None:
    latest: dict[str, float] = monitor.latest()
    for v in views:
        prefix = f"gpu/{v.key}/"
        v.values = {k[len(prefix):]: val for k, val in latest.items() if k.startswith(prefix)}
        _, act = v.activity()
        if act is not None:
            v.history.append(act)


def _run_plain(monitor: Any, views: list[GpuView], args: argparse.Namespace,
               stop: threading.Event) -> None:
    n = 0
    while not stop.wait(args.interval):
        _update(monitor, views)
        try:
            print(plain_line(views), flush=True)
        except BrokenPipeError:  # `gpulens watch | head`
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return
        n += 1
        if args.count is not None and n >= args.count:
            return


def _run_tty(monitor: Any, views: list[GpuView], args: argparse.Namespace, hostname: str,
             backend: str, stop: threading.Event) -> None:
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
    _update(monitor, views)
    fit()
    n = 0
    with _cbreak(fd), Live(render(views, args.interval, hostname, backend), console=console,
                           screen=True, auto_refresh=False) as live:
        live.refresh()
        deadline = time.monotonic() + args.interval
        while not stop.is_set():
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                keys = os.read(fd, 32)
                if not keys or b"q" in keys.lower():
                    return
                continue
            _update(monitor, views)
            fit()
            live.update(render(views, args.interval, hostname, backend), refresh=True)
            n += 1
            if args.count is not None and n >= args.count:
                return
            deadline = time.monotonic() + args.interval
