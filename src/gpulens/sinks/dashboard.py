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
127.0.0.1 unless told otherwise; ``[::1]:PORT`` for IPv6); port 0 picks a free port (a
sink object's :attr:`DashboardSink.url` tells which once it is open).

Where the server runs.  Chosen by name (``"dashboard:8765"``), the sink is built and served in
the engine (its own process, by default), so its threads (one per open page, plus the accept
loop) and the encoding of rows never take the training process's GIL.  The page then lives as
long as the monitor: ``stop()`` ends it (the page keeps what it shows and says that the run
ended).  A port in use is a ``ValueError`` from ``start()``; port 0 is chosen where the server
runs.  When the page is served, gpulens says where: ``gpulens: live dashboard on
http://127.0.0.1:8765/`` on stderr (:func:`gpulens.log.say`, from the engine process too).
A :class:`DashboardSink` object given to a monitor (one with a ``metrics`` provider or a
server of its own, as ``gpulens serve`` makes) is served from the training process.
"""

from __future__ import annotations

from typing import Any

from gpulens.dashboard.server import (
    DEFAULT_HISTORY_ROWS,
    DEFAULT_PORT,
    DashboardServer,
    MetricsProvider,
    PortInUse,
    bind_error,
)
from gpulens.model import Row, RunContext
from gpulens.sinks import check_port, host_port_options, port_taken


class DashboardSink:
    """Serve a live page of the rows (see the module docstring).

    Args:
        port: TCP port (8765); 0 picks a free one.
        host: address to bind; 127.0.0.1 unless you mean to expose the page.
        history_rows: rows kept for pages opened later; older rows are thinned beyond it.
        title: shown on the page.
        metrics: ``() -> (body, content_type)`` served on ``/metrics`` of the same port.
        server: a :class:`~gpulens.dashboard.DashboardServer` made (and perhaps bound) by the
            caller, to publish to; ``port``, ``host``, ``history_rows``, ``title`` and
            ``metrics`` are then the server's.
    """

    on_training_thread = False

    def __init__(self, port: int = DEFAULT_PORT, host: str = "127.0.0.1", *,
                 history_rows: int = DEFAULT_HISTORY_ROWS, title: str = "gpulens",
                 metrics: MetricsProvider | None = None,
                 server: DashboardServer | None = None) -> None:
        if server is not None:
            port, host, title, metrics = server.port, server.host, server.title, server.metrics
            history_rows = server.history_rows
        check_port("dashboard", port)
        if history_rows < 16:
            raise ValueError(f"dashboard sink: history_rows must be >= 16, not {history_rows}")
        self.port = port
        self.host = host
        self.history_rows = history_rows
        self.title = title
        self.metrics = metrics
        self._own_server = server is not None
        self._server: DashboardServer | None = server

    @staticmethod
    def spec_options(arg: str | None) -> dict[str, Any]:
        """``"8765"``, ``"0"`` (a free port), ``"HOST:PORT"``; ``None`` -> 8765 on 127.0.0.1."""
        return host_port_options(
            "dashboard", arg, "'dashboard', 'dashboard:PORT' or 'dashboard:HOST:PORT'")

    @staticmethod
    def check_options(options: dict[str, Any]) -> dict[str, Any]:
        """``ValueError`` (one line) for a port outside 0-65535 or too short a history."""
        check_port("dashboard", options.get("port", DEFAULT_PORT))
        history = options.get("history_rows", DEFAULT_HISTORY_ROWS)
        if not isinstance(history, int) or history < 16:
            raise ValueError(f"dashboard sink: history_rows must be >= 16, not {history!r}")
        return options

    @staticmethod
    def prepare_options(options: dict[str, Any]) -> dict[str, Any]:
        """At start: ``ValueError`` (the words of :meth:`bind`) if the port is taken.  Port 0
        is bound where the sink runs, which says the page's address once it serves."""
        host, port = options.get("host", "127.0.0.1"), options.get("port", DEFAULT_PORT)
        taken = port_taken(host, port)
        if taken is not None:
            raise _port_error(bind_error(host, port, taken)) from None
        return options

    @classmethod
    def from_spec(cls, arg: str | None) -> DashboardSink:
        """The sink of ``"dashboard:..."``, built here."""
        return cls(**cls.check_options(cls.spec_options(arg)))

    def bind(self) -> None:
        """Take the port now (``open()`` serves on it); ``ValueError`` if it cannot."""
        if self._server is None:
            self._server = DashboardServer(self.host, self.port,
                                           history_rows=self.history_rows,
                                           metrics=self.metrics, title=self.title)
        try:
            self._server.bind()
        except ValueError as exc:
            raise _port_error(exc) from None
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
    def url(self) -> str:
        """``http://HOST:PORT/``: the page."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"


def _port_error(exc: ValueError) -> ValueError:
    """The server's bind error, as the sink says it (what to do about a port in use)."""
    if isinstance(exc, PortInUse):
        return PortInUse(
            f"dashboard sink: {exc} (another dashboard or program holds it); choose "
            f"another port ('dashboard:PORT'), or 'dashboard:0' for any free one",
            exc.host, exc.port)
    return ValueError(f"dashboard sink: {exc}")
