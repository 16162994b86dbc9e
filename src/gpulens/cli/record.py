"""``gpulens record [--sink SPEC]... [--interval S] [--work N --unit U] -- COMMAND [ARGS...]``.

Runs COMMAND as a child process and writes one wall-clock row every ``--interval`` seconds
(step = 1, 2, ...) to the sinks for the child's whole life, then prints (on stderr) and writes
(``--summary-json``, ``--summary-md``) a summary per GPU.  Exits with the child's exit code
(128 + N when the child died of signal N).

Signals: SIGINT, SIGTERM and SIGHUP sent to gpulens are passed to the child, and gpulens waits
for the child to end.  A Ctrl-C typed in the terminal already reaches the child (same process
group), so that one is not sent twice.  To tell the two apart the signals are blocked and taken
with ``sigtimedwait``: a terminal-generated signal carries ``si_code == SI_KERNEL``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from gpulens.cli._common import CliError, monitor_interval

SI_KERNEL = 0x80
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WAITED = {*FORWARDED, signal.SIGCHLD}


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


def run_record(args: argparse.Namespace) -> int:
    """Run the child under a monitor; returns the child's exit code."""
    cmd: list[str] = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise CliError("no command given: gpulens record [options] -- COMMAND [ARGS...]")
    _check_output(args.summary_json, "summary JSON")
    _check_output(args.summary_md, "summary Markdown")

    import gpulens
    from gpulens.sinks import resolve_sink
    from gpulens.sinks.prometheus import PrometheusSink
    from gpulens.sinks.summary import SummarySink

    summary = SummarySink()
    try:
        sinks = [resolve_sink(spec) for spec in args.sink]
        for sink in sinks:
            if isinstance(sink, PrometheusSink):
                sink.training = False  # rows count intervals here, not training steps
        monitor = gpulens.Monitor(gpus=args.gpus, interval=monitor_interval(args.interval),
                                  sinks=[*sinks, summary])
    except (ValueError, ImportError) as e:
        raise CliError(str(e)) from None

    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, WAITED)
    try:
        try:
            monitor.start()  # its threads inherit the blocked mask: signals come to us
        except (ValueError, ImportError, OSError) as e:
            raise CliError(str(e)) from None
        try:
            started = time.time()
            pid = _spawn(cmd, set(old_mask))
            status = _supervise(pid, monitor, args.interval)
            ended = time.time()
        finally:
            monitor.stop()
        code = os.waitstatus_to_exitcode(status)
        exit_code = 128 - code if code < 0 else code
        _report(args, cmd, summary, exit_code, started, ended)
        return exit_code
    finally:
        while signal.sigtimedwait(WAITED, 0) is not None:
            pass  # drop signals that arrived after the child ended
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _supervise(pid: int, monitor: Any, interval: float) -> int:
    """Log a row every ``interval`` s, forward signals; returns the child's wait status."""
    step = 0
    next_log = time.monotonic() + interval
    last_log = time.monotonic()
    while True:
        info = signal.sigtimedwait(WAITED, max(0.0, min(next_log - time.monotonic(), 1.0)))
        if info is not None and info.si_signo != signal.SIGCHLD:
            _forward(info, pid)
        wpid, status = os.waitpid(pid, os.WNOHANG)
        now = time.monotonic()
        if wpid == pid:
            if now - last_log > 0.05 * interval or step == 0:
                monitor.log(step + 1)  # the tail since the last row
            return status
        if now >= next_log:
            step += 1
            monitor.log(step)
            last_log = now
            next_log += interval
            if next_log < now:  # fell behind (suspended): restart the cadence
                next_log = now + interval


def _report(args: argparse.Namespace, cmd: list[str], summary: Any, exit_code: int,
            started: float, ended: float) -> None:
    from gpulens.report.text import render_markdown_summary, render_text

    result = summary.result(work=args.work, unit=args.unit)
    # rows here are wall-clock intervals, not training steps
    result.steps = result.first_step = result.last_step = None
    result.energy_per_step_j = None
    title = ("gpulens record: " + " ".join(" ".join(cmd).split()))[:160]
    if not args.quiet:
        sys.stderr.write(render_text(result, title + f" (exit code {exit_code})"))
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
