"""``gpulens watch``: the command (see :mod:`gpulens.cli.watch`): starts a monitor and redraws
the view every interval, in a terminal or as plain lines."""

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
from types import FrameType
from typing import Any

from gpulens.cli._common import CliError, monitor_interval
from gpulens.cli.watch.layout import render
from gpulens.cli.watch.processes import PROCESS_MIN_WIDTH
from gpulens.cli.watch.training import plain_training
from gpulens.cli.watch.view import GpuView, plain_line
from gpulens.report.tail import RecordTail
from gpulens.report.text import gib


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
