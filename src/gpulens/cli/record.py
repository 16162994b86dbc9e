"""``gpulens record [options] [-- COMMAND [ARGS...]]``: GPU rows on a wall-clock axis.

Two ways to run it:

* **Around a command** (``-- COMMAND``): runs COMMAND as a child process and records for the
  child's whole life; exits with the child's exit code (128 + N when the child died of signal
  N).  SIGINT, SIGTERM and SIGHUP sent to gpulens are passed to the child, and gpulens waits
  for the child to end.  A Ctrl-C typed in the terminal already reaches the child (same process
  group), so that one is not sent twice.  To tell the two apart the signals are blocked and
  taken with ``sigtimedwait``: a terminal-generated signal carries ``si_code == SI_KERNEL``.
* **Beside a training** (no command): records until Ctrl-C (SIGINT), SIGTERM or SIGHUP, then
  writes the summary and exits 0.  A live line on stderr shows the newest sample of each GPU
  every ``--interval`` (rewritten in place on a terminal, one line per interval otherwise);
  ``--no-console`` silences it.

Either way one row is written every ``--interval`` seconds to every ``--sink``.  These rows
count wall-clock intervals, not training steps, so they sit on a wall-clock axis:
``record/elapsed_s`` (seconds from the start of the record to the end of the row's window) is
in every row, and W&B plots against it; ``train/global_step`` and the per-step figures
(``perf/steps``, ``perf/step_time_s``, ``perf/energy_per_step_j``, every ``perf/*``) are left
out, and only the advice rules about the hardware judge them: the engine knows the rows are
ticks of a clock (``Monitor(wall_clock=True)``).  The row's ``step`` (the JSONL ``step``
field, MLflow's step) counts the intervals: 1, 2, ... ``--summary-interval S`` prints a
summary of the last S seconds every S seconds; at the end a summary of the whole record is
printed (``--quiet``: not) and written (``--summary-json``, ``--summary-md``).

Sink set-up problems that can be found cheaply (a path that cannot be written, an MLflow
server that refuses connections, a port in use, W&B without a login) are reported in one line
before anything is created; a sink that then fails to open is one WARNING, naming it as written
on the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpulens.cli._common import CliError, monitor_interval

SI_KERNEL = 0x80
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WAITED = {*FORWARDED, signal.SIGCHLD}
ELAPSED_KEY = "record/elapsed_s"
"""Seconds from the start of the record to the end of the row's window."""


class PeriodSummary:
    """Folds rows into a summary of the current period; :meth:`take` returns it and starts the
    next (``--summary-interval``)."""

    on_training_thread = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._context: Any = None
        self._builder: Any = None

    def _new(self) -> Any:
        from gpulens.report.summary import SummaryBuilder

        gpus = self._context.gpus if self._context is not None else ()
        return SummaryBuilder(gpu_names={str(g.index): g.name for g in gpus},
                              mem_total_gb={str(g.index): g.mem_total_gb for g in gpus
                                            if g.mem_total_gb},
                              start_time=time.time())

    def open(self, context: Any) -> None:
        with self._lock:
            self._context = context
            self._builder = self._new()

    def write(self, row: Any) -> None:
        with self._lock:
            if self._builder is not None:
                self._builder.add(row.step, row.time, row.values)

    def close(self) -> None:
        pass

    def take(self) -> Any:
        with self._lock:
            builder, self._builder = self._builder, self._new()
        return builder.result() if builder is not None else None


def _check_output(path: str | None, what: str) -> None:
    if path is None:
        return
    parent = Path(path).resolve().parent
    if Path(path).is_dir():
        raise CliError(f"{what} {path} is a directory")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise CliError(f"cannot write {what} {path}: {parent} is not a writable directory")


def _spawn(cmd: list[str], child_mask: set[int | signal.Signals]) -> int:
    defaults = [*FORWARDED, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD]
    try:
        return os.posix_spawnp(cmd[0], cmd, dict(os.environ), setsigmask=child_mask,
                               setsigdef=defaults)
    except FileNotFoundError:
        raise CliError(f"command not found: {cmd[0]}", code=127) from None
    except PermissionError:
        raise CliError(f"permission denied: {cmd[0]}", code=126) from None
    except OSError as e:
        raise CliError(f"cannot run {cmd[0]}: {e.strerror or e}", code=126) from None


def _forward(info: Any, pid: int) -> None:
    """Pass a signal to the child unless the terminal already sent it to the child too."""
    if info.si_code == SI_KERNEL:
        try:
            same_group = os.getpgid(pid) == os.getpgrp()
        except ProcessLookupError:
            return
        if same_group:
            return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, info.si_signo)


def _sinks(texts: list[str]) -> list[Any]:
    """The ``--sink`` sinks, as specs, set for wall-clock rows where they need to know."""
    from gpulens.sinks import parse_sink, with_options
    from gpulens.sinks.wandb import AXIS_KEY

    out: list[Any] = []
    for text in texts:
        spec = parse_sink(text)
        if spec.kind == "prometheus":
            spec = with_options(spec, training=False)  # rows count intervals, not steps
        if spec.kind == "wandb" and spec.options.get("step_metric", AXIS_KEY) == AXIS_KEY:
            spec = with_options(spec, step_metric=ELAPSED_KEY)
        out.append(spec)
    return out


def run_record(args: argparse.Namespace) -> int:
    """Record around the command (its exit code) or beside a training (0)."""
    cmd: list[str] = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    _check_output(args.summary_json, "summary JSON")
    _check_output(args.summary_md, "summary Markdown")
    if args.summary_interval is not None and args.summary_interval < args.interval:
        raise CliError(f"--summary-interval ({args.summary_interval:g} s) must be at least "
                       f"--interval ({args.interval:g} s)")

    # block the signals before anything can start a thread (wandb's import starts one): a
    # thread that does not block SIGTERM would take it, and its default action ends the process
    # before the row of the tail and the sinks' flush
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, WAITED)
    try:
        return _record_blocked(args, cmd, old_mask)
    finally:
        while signal.sigtimedwait(WAITED, 0) is not None:
            pass  # drop signals that arrived after the end
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _record_blocked(args: argparse.Namespace, cmd: list[str],
                    old_mask: set[int | signal.Signals]) -> int:
    """``run_record`` with ``WAITED`` blocked in this thread and every thread it starts."""
    import gpulens
    from gpulens.settings import Settings
    from gpulens.sinks.summary import SummarySink

    summary = SummarySink()
    period = PeriodSummary() if args.summary_interval else None
    try:
        extra: list[Any] = [summary] if period is None else [summary, period]
        settings = Settings(gpus=tuple(args.gpus) if args.gpus else None,
                            interval=monitor_interval(args.interval),
                            sinks=(*_sinks(args.sink), *extra), wall_clock=True)
        if any(text.strip().lower().startswith("wandb") for text in args.sink):
            # a command of its own can afford importing wandb (a second) to check the login
            # now; a training process's start() leaves that to the sink's opening
            from gpulens.sinks.wandb_run import check_wandb_login

            check_wandb_login()
    except (ValueError, ImportError) as e:
        raise CliError(str(e)) from None
    monitor = gpulens.Monitor.from_settings(settings)
    try:
        # the sinks' checks first (one line, nothing half-made)
        monitor.start()
    except (ValueError, ImportError, OSError) as e:
        raise CliError(str(e)) from None
    live = _LiveLine(monitor, enabled=not cmd and not args.no_console)
    try:
        started = time.time()
        pid = _spawn(cmd, set(old_mask)) if cmd else None
        status = _supervise(pid, monitor, args.interval, live, period, args.summary_interval)
        ended = time.time()
    finally:
        live.end()
        monitor.stop()
    if pid is None:
        exit_code = 0
    else:
        code = os.waitstatus_to_exitcode(status)
        exit_code = 128 - code if code < 0 else code
    _report(args, cmd, summary, exit_code, started, ended)
    return exit_code


def _supervise(pid: int | None, monitor: Any, interval: float, live: _LiveLine,
               period: PeriodSummary | None, summary_interval: float | None) -> int:
    """Log a row every ``interval`` s (``record/elapsed_s`` from now) and forward signals to
    the child; returns the child's wait status, or 0 beside a training once a signal to stop
    came."""
    t0 = time.monotonic()
    step = 0
    next_log = t0 + interval
    last_log = t0
    next_summary = t0 + summary_interval if summary_interval else None

    def mark(now: float) -> None:
        nonlocal step
        step += 1
        monitor.log(step, **{ELAPSED_KEY: round(now - t0, 6)})

    while True:
        wake = next_log if next_summary is None else min(next_log, next_summary)
        info = signal.sigtimedwait(WAITED, max(0.0, min(wake - time.monotonic(), 1.0)))
        now = time.monotonic()
        if pid is None:
            if info is not None and info.si_signo != signal.SIGCHLD:
                if now - last_log > 0.05 * interval or step == 0:
                    mark(now)  # the tail since the last row
                return 0
        else:
            if info is not None and info.si_signo != signal.SIGCHLD:
                _forward(info, pid)
            wpid, status = os.waitpid(pid, os.WNOHANG)
            if wpid == pid:
                if now - last_log > 0.05 * interval or step == 0:
                    mark(now)  # the tail since the last row
                return status
        if now >= next_log:
            mark(now)
            live.show(now - t0)
            last_log = now
            next_log += interval
            if next_log < now:  # fell behind (suspended): restart the cadence
                next_log = now + interval
        if next_summary is not None and period is not None and now >= next_summary:
            _print_period(period, summary_interval or 0.0, now - t0, live)
            next_summary += summary_interval or 0.0
            if next_summary < now:
                next_summary = now + (summary_interval or 0.0)


class _LiveLine:
    """The live line beside a training: the newest sample of each GPU, on stderr."""

    def __init__(self, monitor: Any, *, enabled: bool) -> None:
        self.monitor = monitor
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self._open = False

    def show(self, elapsed: float) -> None:
        if not self.enabled:
            return
        line = live_text(self.monitor.latest(), elapsed)
        if self.tty:
            sys.stderr.write("\r" + line + "\x1b[K")
            self._open = True
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def end(self) -> None:
        """End a line rewritten in place, so what follows starts on a line of its own."""
        if self._open:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._open = False


def live_text(latest: dict[str, float], elapsed: float) -> str:
    """``"[   12 s] gpu0 SM 45% 41.2 GB 320 W 61 C | gpu1 ..."`` from ``Monitor.latest()``;
    a figure a GPU cannot report is left out."""
    gpus: dict[str, dict[str, float]] = {}
    for key, value in latest.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "gpu" and parts[1] != "all":
            gpus.setdefault(parts[1], {})[parts[2]] = value
    pieces = []
    for gpu in sorted(gpus, key=lambda g: (len(g), g)):
        m = gpus[gpu]
        cells = [f"gpu{gpu}"]
        if "sm_active_pct" in m:
            cells.append(f"SM {m['sm_active_pct']:.0f}%")
        elif "util_pct" in m:
            cells.append(f"util {m['util_pct']:.0f}%")
        if "mem_used_gb" in m:
            cells.append(f"{m['mem_used_gb']:.1f} GB")
        if "power_w" in m:
            cells.append(f"{m['power_w']:.0f} W")
        if "temp_c" in m:
            cells.append(f"{m['temp_c']:.0f} C")
        pieces.append(" ".join(cells))
    body = " | ".join(pieces) if pieces else "no GPU figures"
    return f"[{elapsed:6.0f} s] {body}"


def _print_period(period: PeriodSummary, seconds: float, elapsed: float,
                  live: _LiveLine) -> None:
    from gpulens.report.text import duration, render_text

    result = period.take()
    if result is None:
        return
    result.steps = result.first_step = result.last_step = None
    result.energy_per_step_j = result.step_time_mean_s = None
    live.end()
    sys.stderr.write(render_text(result, f"gpulens record: the last {seconds:g} s "
                                          f"(after {duration(elapsed)})"))
    sys.stderr.flush()


def _report(args: argparse.Namespace, cmd: list[str], summary: Any, exit_code: int,
            started: float, ended: float) -> None:
    from gpulens.report.text import render_markdown_summary, render_text

    result = summary.result(work=args.work, unit=args.unit)
    # rows here are wall-clock intervals, not training steps
    result.steps = result.first_step = result.last_step = None
    result.energy_per_step_j = result.step_time_mean_s = None
    if cmd:
        title = ("gpulens record: " + " ".join(" ".join(cmd).split()))[:160]
        ending = f" (exit code {exit_code})"
    else:
        title, ending = "gpulens record (beside a training)", ""
    if not args.quiet:
        sys.stderr.write(render_text(result, title + ending))
        sys.stderr.flush()
    if args.summary_json:
        data = {"command": cmd, "exit_code": exit_code, "started": started, "ended": ended,
                **result.to_dict()}
        _write(args.summary_json, json.dumps(data, indent=2) + "\n")
    if args.summary_md:
        _write(args.summary_md, render_markdown_summary(result, title) +
               f"\nExit code: {exit_code}\n")


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        print(f"gpulens record: error: cannot write {path}: {e.strerror or e}", file=sys.stderr)
