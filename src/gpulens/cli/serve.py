"""``gpulens serve [--port 9400] [--host 127.0.0.1] [--interval S] [--gpus 0,1]``.

Live GPU metrics for the whole node, on one port:

* ``/`` the live dashboard: every GPU's activity, memory, power, temperature and clocks, one
  chart per metric with every GPU on it, ranges from the last 5 minutes to the whole session;
* ``/metrics`` a Prometheus exporter (no training metrics: use the ``prometheus:PORT`` or
  ``dashboard:PORT`` sink inside the training process for those);
* ``/events`` the page's stream of server-sent events.

Every ``--interval`` seconds the monitor closes a window (the first after a quarter of a second):
one row, whose x-axis is the time since ``serve`` started (``record/elapsed_s``); a scrape
returns the latest window's figures.  The rows are ticks of a clock, not training steps
(``Monitor(wall_clock=True)``): no per-step figures, no advice about training, only about the
hardware (power cap, heat).  The addresses are printed once the first row is on the
page, so a page opened then shows data at once.
It binds 127.0.0.1 unless ``--host`` says otherwise.  A port that is taken is one line naming
the port and what to do (exit code 2).  SIGINT/SIGTERM stop it cleanly.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING

from gpulens.cli._common import CliError, monitor_interval

if TYPE_CHECKING:
    from gpulens import Monitor
    from gpulens.dashboard.server import DashboardServer

ELAPSED_KEY = "record/elapsed_s"
FIRST_ROW_S = 0.25
"""Seconds to the first row (then every ``--interval``): the page has data soon after start."""
FIRST_ROW_WAIT_S = 10.0
"""How long the addresses wait for the first row to be on the page before they are printed
anyway."""


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; exit code 0, or 2 when the port cannot be bound."""
    import gpulens
    from gpulens.dashboard.server import DashboardServer, PortInUse
    from gpulens.sinks.dashboard import DashboardSink
    from gpulens.sinks.prometheus import PrometheusSink

    prom = PrometheusSink(port=args.port, host=args.host, training=False, http=False)
    server = DashboardServer(args.host, args.port, metrics=prom.exposition,
                             title="gpulens serve", announce=False)
    try:
        server.bind()  # before anything starts: a taken port is said at once
    except PortInUse as e:
        raise CliError(f"port {e.port} on {e.host} is already in use (another 'gpulens serve' "
                       f"or program holds it); choose another with --port N, or --port 0 for "
                       f"any free port") from None
    except ValueError as e:
        raise CliError(str(e)) from None
    try:
        try:
            monitor = gpulens.Monitor(gpus=args.gpus, interval=monitor_interval(args.interval),
                                      sinks=[prom, DashboardSink(server=server)],
                                      wall_clock=True)
        except (ValueError, ImportError) as e:
            raise CliError(str(e)) from None
        _serve(monitor, server, args.interval)
    finally:
        server.close()
    return 0


def _serve(monitor: Monitor, server: DashboardServer, interval: float) -> None:
    """Start the monitor, log a row every ``interval`` s until SIGINT/SIGTERM, stop it.

    The first row is closed after :data:`FIRST_ROW_S` (or ``interval``, if shorter), and the
    addresses are printed once that row is on the page: a page opened then shows data at once.
    """
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            monitor.start()
        except (ValueError, ImportError, OSError) as e:
            raise CliError(str(e)) from None
        try:
            started = time.monotonic()
            due = started + min(interval, FIRST_ROW_S)
            step = 0
            while not stop.wait(max(0.0, due - time.monotonic())):
                step += 1
                now = time.monotonic()
                monitor.log(step, **{ELAPSED_KEY: round(now - started, 3)})
                # after an early first row, back on the interval's beat
                due = started + interval if step == 1 and interval > FIRST_ROW_S else due + interval
                if due < now:  # fell behind (suspended): start the beat again
                    due = now + interval
                if step == 1:
                    _say_where(monitor, server, interval)
        finally:
            monitor.stop()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _say_where(monitor: Monitor, server: DashboardServer, interval: float) -> None:
    """Print what is served where, once the first row is on the page (at most
    :data:`FIRST_ROW_WAIT_S` later: a page opened then gets what comes)."""
    server.wait_for_rows(1, FIRST_ROW_WAIT_S)
    context = monitor.context
    gpus = len(context.gpus) if context else 0
    simulated = " (SIMULATED)" if context and context.backend == "simulated" else ""
    url = server.url
    print(f"gpulens serve: {gpus} GPU(s){simulated} every {interval:g} s; dashboard on "
          f"{url}, metrics on {url}metrics (Ctrl-C stops)", file=sys.stderr, flush=True)
