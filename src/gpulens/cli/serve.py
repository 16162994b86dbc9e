"""``gpulens serve [--port 9400] [--host 127.0.0.1] [--interval S] [--gpus 0,1]``.

Live GPU metrics for the whole node, on one port:

* ``/`` the live dashboard: every GPU's activity, memory, power, temperature and clocks, one
  chart per metric with every GPU on it, ranges from the last 5 minutes to the whole session;
* ``/metrics`` a Prometheus exporter (no training metrics: use the ``prometheus:PORT`` or
  ``dashboard:PORT`` sink inside the training process for those);
* ``/events`` the page's stream of server-sent events.

Every ``--interval`` seconds the monitor closes a window: one row, whose x-axis is the time
since ``serve`` started (``record/elapsed_s``); a scrape returns the latest window's figures.
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

ELAPSED_KEY = "record/elapsed_s"


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; exit code 0, or 2 when the port cannot be bound."""
    import gpulens
    from gpulens.dashboard.server import DashboardServer, PortInUse
    from gpulens.sinks.dashboard import DashboardSink
    from gpulens.sinks.prometheus import PrometheusSink

    prom = PrometheusSink(port=args.port, host=args.host, training=False, http=False)
    server = DashboardServer(args.host, args.port, metrics=prom.exposition,
                             title="gpulens serve")
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
                                      sinks=[prom, DashboardSink(server=server)])
        except (ValueError, ImportError) as e:
            raise CliError(str(e)) from None
        _serve(monitor, server.url, args.interval)
    finally:
        server.close()
    return 0


def _serve(monitor: Monitor, url: str, interval: float) -> None:
    """Start the monitor, log a row every ``interval`` s until SIGINT/SIGTERM, stop it."""
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
            context = monitor.context
            gpus = len(context.gpus) if context else 0
            simulated = " (SIMULATED)" if context and context.backend == "simulated" else ""
            print(f"gpulens serve: {gpus} GPU(s){simulated} every {interval:g} s; dashboard on "
                  f"{url}, metrics on {url}metrics (Ctrl-C stops)", file=sys.stderr,
                  flush=True)
            started = time.monotonic()
            step = 0
            while not stop.wait(interval):
                step += 1
                monitor.log(step, **{ELAPSED_KEY: round(time.monotonic() - started, 3)})
        finally:
            monitor.stop()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
