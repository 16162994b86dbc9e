"""Live web dashboard sink: ``sinks=["dashboard:8765"]`` serves a page of per-step charts on
``http://127.0.0.1:8765/`` for as long as the monitor runs.

The page shows loss, learning rate and gradient norm beside GPU activity (SM, tensor-core and
NVML utilization), memory, power and energy, MFU and throughput once rows carry
``perf/mfu_pct`` / ``perf/tokens_per_s``, temperature, clocks and throttling, with every GPU
of a metric on one chart; the advice and alert history (the rows' events and ``alerts/<rule>``
keys); ranges from the last 5 minutes to the whole run.  A row reaches an open page within
milliseconds of the sink receiving it (server-sent events); a page opened late gets the
history first.  See :mod:`gpulens.dashboard.server` for the bounds (history, slow pages).

Specs: ``"dashboard"`` (port 8765), ``"dashboard:PORT"``, ``"dashboard:HOST:PORT"`` (binds
127.0.0.1 unless told otherwise; ``[::1]:PORT`` for IPv6); port 0 picks a free port, then
:attr:`DashboardSink.url` tells which.  ``Monitor.start()`` prints the address on stderr
(``gpulens: live dashboard on http://127.0.0.1:8765/``) once the page is served.

Where the server runs.  The sink has a :meth:`~DashboardSink.remote_spec`: with the engine in
a process of its own (``Monitor``'s default), the server lives in that process, so its
threads (one per open page, plus the accept loop) and the encoding of rows never take the
training process's GIL.  The page then lives as long as the monitor: ``stop()`` ends it (the
page keeps what it shows and says that the run ended).  In a distributed job rows meet on rank
0 first, so the server runs in rank 0's training process (a thread per page, mostly asleep).
A sink given a ``metrics`` provider or a server of its own (``gpulens serve``) stays where it
was made.
"""

from __future__ import annotations

import socket
from typing import Any

from gpulens.dashboard.server import (
    DEFAULT_HISTORY_ROWS,
    DEFAULT_PORT,
    DashboardServer,
    MetricsProvider,
    PortInUse,
)
from gpulens.model import Row, RunContext


class DashboardSink:
    """Serve a live page of the rows (see the module docstring).

    Args:
        port: TCP port (8765); 0 picks a free one.
        host: address to bind; 127.0.0.1 unless you mean to expose the page.
        history_rows: rows kept for pages opened later; older rows are thinned beyond it.
        title: shown on the page.
        metrics: ``() -> (body, content_type)`` served on ``/metrics`` of the same port (a
            sink with one is not moved to the engine process).
        server: a :class:`~gpulens.dashboard.DashboardServer` made (and perhaps bound) by the
            caller, to publish to; ``port``, ``host``, ``history_rows``, ``title`` and
            ``metrics`` are then the server's.  The sink stays in this process.
    """

    on_training_thread = False

    def __init__(self, port: int = DEFAULT_PORT, host: str = "127.0.0.1", *,
                 history_rows: int = DEFAULT_HISTORY_ROWS, title: str = "gpulens",
                 metrics: MetricsProvider | None = None,
                 server: DashboardServer | None = None) -> None:
        if server is not None:
            port, host, title, metrics = server.port, server.host, server.title, server.metrics
            history_rows = server.history_rows
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"dashboard sink: port must be 0-65535, not {port!r}")
        if history_rows < 16:
            raise ValueError(f"dashboard sink: history_rows must be >= 16, not {history_rows}")
        self.port = port
        self.host = host
        self.history_rows = history_rows
        self.title = title
        self.metrics = metrics
        self._own_server = server is not None
        self._server: DashboardServer | None = server

    @classmethod
    def from_spec(cls, arg: str | None) -> DashboardSink:
        """``"8765"``, ``"0"`` (a free port), ``"HOST:PORT"``; ``None`` -> 8765 on 127.0.0.1."""
        if arg is None or not arg.strip():
            return cls()
        host, sep, port_text = arg.strip().rpartition(":")
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(
                f"dashboard sink: expected 'dashboard', 'dashboard:PORT' or "
                f"'dashboard:HOST:PORT', got 'dashboard:{arg}'"
            ) from None
        if not 0 <= port <= 65535:
            raise ValueError(f"dashboard sink: port must be 0-65535, not {port}")
        return cls(port=port, host=host.strip("[]") if sep and host else "127.0.0.1")

    def remote_spec(self) -> tuple[str, dict[str, Any]] | None:
        """How the engine process rebuilds this sink (the server then lives there).

        Port 0 is resolved here first (a free port is chosen now), so that :attr:`url` in this
        process names the port the page is served on.  ``None`` (stay here) when the sink has
        a ``metrics`` provider (which cannot cross to another process) or a server given.
        """
        if self.metrics is not None or self._own_server:
            return None
        if self.port == 0:
            self.port = _free_port(self.host)
        return "gpulens.sinks.dashboard:DashboardSink", {
            "port": self.port, "host": self.host, "history_rows": self.history_rows,
            "title": self.title}

    def bind(self) -> None:
        """Take the port now (``open()`` serves on it); ``ValueError`` if it cannot."""
        if self._server is None:
            self._server = DashboardServer(self.host, self.port,
                                           history_rows=self.history_rows,
                                           metrics=self.metrics, title=self.title)
        try:
            self._server.bind()
        except PortInUse as exc:
            raise PortInUse(
                f"dashboard sink: {exc} (another dashboard or program holds it); choose "
                f"another port ('dashboard:PORT'), or 'dashboard:0' for any free one",
                exc.host, exc.port) from None
        except ValueError as exc:
            raise ValueError(f"dashboard sink: {exc}") from None
        self.port = self._server.port

    def open(self, context: RunContext) -> None:
        """Bind (unless :meth:`bind` did) and serve; ``ValueError`` if the port is taken."""
        self.bind()
        assert self._server is not None
        self._server.start(context)

    def write(self, row: Row) -> None:
        """Keep the row and push it to every open page (never waits on a page)."""
        server = self._server
        if server is None:
            raise RuntimeError("dashboard sink: write() before open()")
        server.publish(row)

    def close(self) -> None:
        """Tell the pages that the run ended and free the port."""
        server, self._server = self._server, None
        if server is not None:
            server.close()

    @property
    def server(self) -> DashboardServer | None:
        """The server once bound (its ``stats``), else ``None``."""
        return self._server

    @property
    def page_url(self) -> str | None:
        """The page's address for :class:`~gpulens.Monitor` to print when it starts
        (``None`` for a sink given a server: whoever made the server says where it is)."""
        return None if self._own_server else self.url

    @property
    def url(self) -> str:
        """``http://HOST:PORT/``: the page."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"


def _free_port(host: str) -> int:
    """A port free on ``host`` now (the OS's choice for port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port: int = s.getsockname()[1]
            return port
    except OSError as exc:
        raise ValueError(f"dashboard sink: cannot serve on {host}: {exc.strerror or exc}"
                         ) from None
