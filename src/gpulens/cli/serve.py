"""``gpulens serve [--port 9400] [--host 127.0.0.1] [--interval S] [--gpus 0,1]``.

A Prometheus exporter of live GPU metrics for the whole node (no training metrics: use the
``prometheus:PORT`` sink inside the training process for those).  Every ``--interval`` seconds
the monitor closes a window; a scrape returns the latest window's figures.  SIGINT/SIGTERM stop
it cleanly.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from gpulens.cli._common import CliError, monitor_interval


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; exit code 0, or 2 when the port cannot be bound."""
    import gpulens
    from gpulens.sinks.prometheus import PrometheusSink

    try:
        sink = PrometheusSink(port=args.port, host=args.host, training=False)
        monitor = gpulens.Monitor(gpus=args.gpus, interval=monitor_interval(args.interval),
                                  sinks=[sink])
    except (ValueError, ImportError) as e:
        raise CliError(str(e)) from None
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
            gpus = len(monitor.context.gpus) if monitor.context else 0
            print(f"gpulens serve: {gpus} GPU(s), metrics on {sink.url} every "
                  f"{args.interval:g} s (Ctrl-C stops)", file=sys.stderr, flush=True)
            step = 0
            while not stop.wait(args.interval):
                step += 1
                monitor.log(step)
        finally:
            monitor.stop()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return 0
