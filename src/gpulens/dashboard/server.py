"""The dashboard's HTTP server: the page, a server-sent-event stream of rows, ``/metrics``.

Why the standard library (``http.server.ThreadingHTTPServer``) and not Starlette +
sse-starlette: server-sent events are a plain HTTP response that never ends, which the standard
library writes as well as any framework; Starlette would add an ASGI server (uvicorn), anyio
and an event loop thread to the process that hosts the sink (the engine process, see
:mod:`gpulens.sinks.dashboard`), for nothing this page needs.  The cost of the threading server
is a thread per connected page, so connections are capped (``max_clients``, 32 by default);
a dashboard has a handful of viewers.

How a row travels.  :meth:`DashboardServer.publish` (called from a gpulens delivery thread)
encodes the row once, appends it to the history and to a ring of the latest messages
(``backlog`` of them), and wakes the page threads; it never touches a socket, so no client,
however slow, can hold it up.  Each page's thread sends what the ring holds beyond what that
page has seen, in one write.  A page that falls further behind than the ring reaches is
disconnected (counted in :attr:`DashboardServer.stats`, one WARNING); its browser reconnects
by itself after 2 s and gets the history again, so a page never shows a row missing in the
middle.  A send that stalls for ``send_timeout_s`` (10 s) ends that page's connection (counted
the same way).

The history (what a page that opens late gets first) is bounded: at most ``history_rows``
rows (8192 by default).  When it is full, its older half is thinned (every second row
dropped), so the newest half is always complete, the first row is always kept, and older
stretches get coarser each time: a run of any length is shown from its first step, in at most
``history_rows`` rows.  A row is kept as its encoded text, about 7.5 bytes a value: measured
1.43 KB for a row of 8 simulated GPUs (191 keys) and 0.27 KB for one GPU (28 keys), so 11.7 MB
and 2.2 MB for a full history (``benchmarks/dashboard_clients.py``,
``benchmarks/results/2026-11-26-cpu-dashboard/``).  At most ``MAX_EVENTS`` events (alerts,
notices) are kept, the oldest dropped first.

The stream (``/events``), one ``event:`` type per message, data in JSON:

``hello``  ``{"run", "title", "context": {"hostname", "backend", "interval", "gpus": [...]},
           "keys": [...], "history_rows"}``: first on every connection; the page resets to
           it.
``keys``   names appended to the key list: a row's values are positional on that list.
``rows``   ``[[step, unix_time, v0, v1, ...], ...]``; ``null`` (or a short row) = absent.
``events`` ``[{"kind", "name", "state", "step", "time", "severity", "message", "advice",
           "data"}, ...]`` (:class:`gpulens.model.Event`).  A change of an
           ``alerts/<rule>`` key that comes without an alert event of that rule is told as
           one too (message: only the key's value).
``end``    the server is closing (the run ended).
"""

from __future__ import annotations

import errno
import itertools
import json
import math
import secrets
import socket
import socketserver
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from gpulens.log import logger, say, warn_once
from gpulens.model import Event, Row, RunContext

DEFAULT_PORT = 8765
DEFAULT_HISTORY_ROWS = 8192
DEFAULT_MAX_CLIENTS = 32
DEFAULT_BACKLOG = 2048
"""Messages (one per row) a page may be behind before it is disconnected."""
MAX_EVENTS = 2000
MAX_KEYS = 4096
"""Distinct keys kept; a row's keys beyond this are left out (one WARNING)."""
KEEPALIVE_S = 15.0
SEND_TIMEOUT_S = 10.0
HISTORY_CHUNK = 512
RETRY_MS = 2000

MetricsProvider = Callable[[], tuple[bytes, str]]
"""Returns ``(body, content_type)`` for ``/metrics``."""


class PortInUse(ValueError):
    """The port is held by another socket (a user error: choose another port)."""

    def __init__(self, message: str, host: str, port: int) -> None:
        super().__init__(message)
        self.host = host
        self.port = port


@dataclass
class DashboardStats:
    """What the server did so far."""

    rows: int = 0
    """Rows published."""
    history_rows: int = 0
    """Rows kept in the history now."""
    thinned: int = 0
    """Rows dropped from the history by thinning (see the module doc)."""
    clients: int = 0
    """Pages connected now."""
    clients_total: int = 0
    """Connections to ``/events`` so far."""
    clients_dropped_slow: int = 0
    """Pages disconnected for falling more than ``backlog`` rows behind, or for taking no data
    for ``send_timeout_s``."""
    clients_refused: int = 0
    """Connections refused because ``max_clients`` were connected."""


def _num(value: Any) -> str:
    """A value as compact JSON: integers exact, others to 7 significant digits; not finite or
    not a number -> ``null``."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        return "null"
    if not math.isfinite(f):
        return "null"
    if f.is_integer() and abs(f) < 1e15:
        return str(int(f))
    return format(f, ".7g")


def _finite_or_none(value: Any) -> float | None:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _event_json(e: Event) -> str:
    return json.dumps({
        "kind": e.kind, "name": e.name, "state": e.state, "step": e.step,
        "time": round(e.time, 3), "severity": e.severity, "message": e.message,
        "advice": e.advice, "data": {k: _finite_or_none(v) for k, v in e.data.items()},
    }, separators=(",", ":"), allow_nan=False)


def _sse(kind: str, data: str) -> bytes:
    return f"event: {kind}\ndata: {data}\n\n".encode()


class _History:
    """The keys, the bounded history of encoded rows, the events, the alert states."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.keys: list[str] = []
        self.index: dict[str, int] = {}
        self.rows: list[str] = []
        self.thinned = 0
        self.events: deque[str] = deque(maxlen=MAX_EVENTS)
        self.alerts: dict[str, bool] = {}

    def add(self, row: Row) -> tuple[list[str], str, list[str]]:
        """Encode ``row``; returns (new keys, the encoded row, encoded events)."""
        new: list[str] = []
        cells: dict[int, str] = {}
        for key, value in row.values.items():
            i = self.index.get(key)
            if i is None:
                if len(self.keys) >= MAX_KEYS:
                    warn_once("dashboard-keys", "gpulens: the dashboard keeps at most %d "
                              "distinct keys; later new keys are left out of it", MAX_KEYS)
                    continue
                i = self.index[key] = len(self.keys)
                self.keys.append(key)
                new.append(key)
            cells[i] = _num(value)
        parts = ["null"] * (max(cells) + 1 if cells else 0)
        for i, text in cells.items():
            parts[i] = text
        encoded = f"[{int(row.step)},{row.time:.3f}{',' if parts else ''}{','.join(parts)}]"
        if len(self.rows) >= self.max_rows:
            half = len(self.rows) // 2
            kept = self.rows[:half:2]
            self.thinned += half - len(kept)
            self.rows = kept + self.rows[half:]
        self.rows.append(encoded)
        events = [_event_json(e) for e in row.events]
        told = set()
        for e in row.events:
            if e.kind == "alert":
                told.add(e.name)
                self.alerts[e.name] = e.state == "firing"
        for key, value in row.values.items():
            if not key.startswith("alerts/"):
                continue
            name = key[len("alerts/"):]
            v = _finite_or_none(value)
            if v is None or name in told:
                continue
            firing = v >= 0.5
            if firing != self.alerts.get(name, False):
                self.alerts[name] = firing
                events.append(_event_json(Event(
                    kind="alert", name=name, state="firing" if firing else "resolved",
                    step=int(row.step), time=row.time,
                    message=f"{key} = {_num(v)} (no message came with it)")))
        self.events.extend(events)
        return new, encoded, events


ASSETS: dict[str, tuple[str, str]] = {
    "/": ("page.html", "text/html; charset=utf-8"),
    "/index.html": ("page.html", "text/html; charset=utf-8"),
    "/page.css": ("page.css", "text/css; charset=utf-8"),
    "/chart.js": ("chart.js", "text/javascript; charset=utf-8"),
    "/page.js": ("page.js", "text/javascript; charset=utf-8"),
}
"""The page's files, by path: (file of this package, content type)."""
_FILES: dict[str, bytes] = {}


def asset(name: str) -> bytes:
    """A file of the page (``page.html``, ``page.css``, ``chart.js``, ``page.js``), read once
    from the package."""
    body = _FILES.get(name)
    if body is None:
        body = _FILES[name] = resources.files("gpulens.dashboard").joinpath(name).read_bytes()
    return body


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    dashboard: DashboardServer

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks the host's name up (socket.getfqdn), which can wait on
        # DNS; the name is not needed.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A request failed beyond a page going away (those end quietly in the handler):
        one WARNING per process, the traceback at DEBUG; the server goes on."""
        exc = sys.exc_info()[1]
        warn_once("dashboard-request", "gpulens: a dashboard request failed: %r (the "
                  "dashboard goes on)", exc)
        logger.debug("gpulens: dashboard request from %s failed", client_address,
                     exc_info=True)


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    timeout = SEND_TIMEOUT_S
    server_version = "gpulens-dashboard"

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.dashboard.send_timeout_s)  # for every send

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged (the base class writes each to stderr)."""

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        dash = self.server.dashboard
        try:
            if path in ASSETS:
                name, content_type = ASSETS[path]
                self._reply(200, asset(name), content_type)
            elif path == "/events":
                dash._stream(self)
            elif path == "/metrics":
                dash._metrics(self)
            else:
                self._reply(404, b"not found: the dashboard serves /, /events and /metrics\n",
                            "text/plain; charset=utf-8")
        except (OSError, ValueError):
            pass  # the page went away (reset, broken pipe, timeout; or its file closed)

    def _reply(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)


def bind_error(host: str, port: int, exc: OSError) -> ValueError:
    if exc.errno == errno.EADDRINUSE:
        return PortInUse(f"port {port} on {host} is already in use", host, port)
    if exc.errno == errno.EACCES:
        return ValueError(f"cannot serve on {host}:{port}: permission denied"
                          + (" (ports below 1024 need privileges)" if 0 < port < 1024 else ""))
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return ValueError(f"cannot serve on {host}:{port}: {host!r} is not an address of this "
                          f"machine ({exc.strerror or exc})")
    return ValueError(f"cannot serve on {host}:{port}: {exc.strerror or exc}")


class DashboardServer:
    """Serves the page, the event stream and (with ``metrics``) ``/metrics`` on one port.

    Args:
        host: address to bind; 127.0.0.1 unless you mean to expose the page.
        port: TCP port; 0 picks a free one (:attr:`port` tells which after :meth:`bind`).
        history_rows: rows kept for pages that open later (see the module doc), >= 16.
        max_clients: pages connected at once; more are answered 503.
        backlog: rows a page may fall behind before it is disconnected (it reconnects).
        metrics: ``() -> (body, content_type)`` served on ``/metrics``.
        title: shown on the page.
        keepalive_s: seconds between keep-alive comments on an idle stream.
        send_timeout_s: a send to a page that stalls this long ends its connection (counted
            as a slow page).
        announce: say ``gpulens: live dashboard on URL`` when it starts serving
            (:func:`gpulens.log.say`: heard by default, from the engine process too); off for
            a caller that says where it serves itself (``gpulens serve``).

    Nothing happens in the constructor: :meth:`bind` takes the port (``PortInUse`` or
    ``ValueError`` if it cannot), :meth:`start` serves, :meth:`publish` sends rows,
    :meth:`close` ends every stream with an ``end`` message and frees the port.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                 history_rows: int = DEFAULT_HISTORY_ROWS,
                 max_clients: int = DEFAULT_MAX_CLIENTS, backlog: int = DEFAULT_BACKLOG,
                 metrics: MetricsProvider | None = None, title: str = "gpulens",
                 keepalive_s: float = KEEPALIVE_S,
                 send_timeout_s: float = SEND_TIMEOUT_S, announce: bool = True) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"dashboard: port must be 0-65535, not {port!r}")
        if history_rows < 16:
            raise ValueError(f"dashboard: history_rows must be >= 16, not {history_rows}")
        if max_clients < 1 or backlog < 1:
            raise ValueError("dashboard: max_clients and backlog must be >= 1")
        self.host = host
        self.port = port
        self.max_clients = max_clients
        self.metrics = metrics
        self.title = title
        self.keepalive_s = keepalive_s
        self.send_timeout_s = send_timeout_s
        self.announce = announce
        self.run_id = secrets.token_hex(6)
        self._cond = threading.Condition()
        self.history_rows = history_rows
        self._history = _History(history_rows)
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=backlog)
        self._seq = 0
        self._closing = False
        self._stats = DashboardStats()
        self._context: dict[str, Any] = {}
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- life ------------------------------------------------------------------------------
    def bind(self) -> None:
        """Take the port now (idempotent); ``PortInUse`` / ``ValueError`` if it cannot."""
        if self._httpd is not None:
            return
        cls = _HTTPServer6 if ":" in self.host else _HTTPServer
        try:
            httpd = cls((self.host, self.port), _Handler)
        except OSError as exc:
            raise bind_error(self.host, self.port, exc) from None
        httpd.dashboard = self
        self._httpd = httpd
        self.port = httpd.server_port

    def start(self, context: RunContext | None = None) -> None:
        """Bind (if not yet) and serve in a thread of its own; ``context`` names the GPUs."""
        self.bind()
        with self._cond:
            self._context = _context_json(context)
        if self._thread is None:
            assert self._httpd is not None
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                name="gpulens-dashboard", daemon=True)
            self._thread.start()
            if self.announce:
                say("gpulens: live dashboard on %s", self.url)

    def close(self, timeout: float = 2.0) -> None:
        """Tell every page the run ended, stop serving, free the port.  Idempotent."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            # let the pages' threads send "end" (they wake now; a stalled one is not waited)
            self._cond.wait_for(lambda: self._stats.clients == 0,
                                max(0.0, min(1.0, deadline - time.monotonic())))
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            if self._thread is not None:
                httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
            self._thread = None

    @property
    def url(self) -> str:
        """``http://HOST:PORT/``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    @property
    def stats(self) -> DashboardStats:
        """A copy of the counters."""
        with self._cond:
            s = DashboardStats(**vars(self._stats))
            s.history_rows = len(self._history.rows)
            s.thinned = self._history.thinned
            return s

    def wait_for_rows(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` rows were published (or the server closes); whether they
        were, within ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: self._stats.rows >= count or self._closing, timeout)
            return self._stats.rows >= count

    def history_bytes(self) -> int:
        """Bytes held by the history's row texts (``sys.getsizeof`` of each)."""
        with self._cond:
            return sum(sys.getsizeof(r) for r in self._history.rows)

    # -- rows ------------------------------------------------------------------------------
    def publish(self, row: Row) -> None:
        """Keep ``row`` and send it to every connected page.  Never blocks on a page."""
        with self._cond:
            if self._closing:
                return
            new, encoded, events = self._history.add(row)
            blob = b"".join((
                _sse("keys", json.dumps(new)) if new else b"",
                _sse("rows", f"[{encoded}]"),
                _sse("events", f"[{','.join(events)}]") if events else b"",
            ))
            self._seq += 1
            self._ring.append((self._seq, blob))
            self._stats.rows += 1
            self._cond.notify_all()

    # -- requests (page threads) -----------------------------------------------------------
    def _stream(self, h: _Handler) -> None:
        with self._cond:
            if self._closing:
                h._reply(503, b"the run ended\n", "text/plain; charset=utf-8")
                return
            if self._stats.clients >= self.max_clients:
                self._stats.clients_refused += 1
                refused = True
            else:
                refused = False
                self._stats.clients += 1
                self._stats.clients_total += 1
                rows = list(self._history.rows)
                events = list(self._history.events)
                cursor = self._seq
                hello = json.dumps({"run": self.run_id, "title": self.title,
                                    "context": self._context, "keys": self._history.keys,
                                    "history_rows": self._history.max_rows})
        if refused:
            warn_once("dashboard-full", "gpulens: the dashboard refused a page: %d are "
                      "connected already (max_clients)", self.max_clients)
            h._reply(503, f"too many dashboard pages open ({self.max_clients})\n".encode(),
                     "text/plain; charset=utf-8")
            return
        try:
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream; charset=utf-8")
            h.send_header("Cache-Control", "no-store")
            h.send_header("X-Accel-Buffering", "no")
            h.end_headers()
            out = [f"retry: {RETRY_MS}\n".encode(), _sse("hello", hello)]
            for i in range(0, len(rows), HISTORY_CHUNK):
                out.append(_sse("rows", "[" + ",".join(rows[i:i + HISTORY_CHUNK]) + "]"))
            if events:
                out.append(_sse("events", "[" + ",".join(events) + "]"))
            h.wfile.write(b"".join(out))
            del rows, events, out
            self._follow(h, cursor)
        except TimeoutError:
            with self._cond:
                self._stats.clients_dropped_slow += 1
            warn_once("dashboard-stalled", "gpulens: a dashboard page took no data for %g s "
                      "and was disconnected (it reconnects and gets the history again)",
                      self.send_timeout_s)
        finally:
            with self._cond:
                self._stats.clients -= 1
                self._cond.notify_all()

    def _follow(self, h: _Handler, cursor: int) -> None:
        while True:
            blobs: list[bytes] = []
            lagged = False
            with self._cond:
                if self._seq == cursor and not self._closing:
                    self._cond.wait(self.keepalive_s)
                closing = self._closing
                behind = self._seq - cursor
                if behind:
                    if behind > len(self._ring):
                        self._stats.clients_dropped_slow += 1
                        lagged = True
                    else:
                        start = len(self._ring) - behind
                        blobs = [b for _, b in itertools.islice(self._ring, start, None)]
                        cursor = self._seq
            if lagged:
                warn_once("dashboard-slow", "gpulens: a dashboard page fell more than %d rows "
                          "behind and was disconnected (it reconnects and gets the history "
                          "again)", self._ring.maxlen)
                return
            if blobs:
                h.wfile.write(b"".join(blobs))
            elif closing:
                h.wfile.write(_sse("end", "{}"))
                return
            else:
                h.wfile.write(b": keep-alive\n\n")

    def _metrics(self, h: _Handler) -> None:
        if self.metrics is None:
            h._reply(404, b"no /metrics here: use 'gpulens serve', or a 'prometheus:PORT' "
                          b"sink\n", "text/plain; charset=utf-8")
            return
        try:
            body, content_type = self.metrics()
        except Exception as exc:
            warn_once("dashboard-metrics", "gpulens: /metrics failed: %r", exc)
            h._reply(500, f"metrics failed: {exc!r}\n".encode(), "text/plain; charset=utf-8")
            return
        h._reply(200, body, content_type)


def _context_json(context: RunContext | None) -> dict[str, Any]:
    if context is None:
        return {}
    return {
        "hostname": context.hostname,
        "backend": context.backend,
        "interval": context.interval,
        "gpus": [{"index": g.index, "name": g.name, "uuid": g.uuid,
                  "pci_bus_id": g.pci_bus_id, "mem_total_gb": g.mem_total_gb,
                  "power_limit_w": g.power_limit_w} for g in context.gpus],
    }

