"""A reader of the dashboard's server-sent-event stream, decoding it as the page does.

``DashboardReader(url)`` connects to ``/events``; :meth:`DashboardReader.until` reads messages
until a condition on what was read holds.  Rows are decoded to ``{"step", "time", "values"}``
with the positional key list (``hello`` then ``keys`` messages).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Callable
from typing import Any


class StreamEnded(Exception):
    """The server closed the stream (with or without an ``end`` message)."""


class DashboardReader:
    """One page's view of the stream."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        parts = urllib.parse.urlsplit(url)
        assert parts.hostname is not None and parts.port is not None, url
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        self.conn.request("GET", "/events")
        self.response = self.conn.getresponse()
        self.status = self.response.status
        self.content_type = self.response.getheader("Content-Type", "")
        self.hello: dict[str, Any] | None = None
        self.keys: list[str] = []
        self.rows: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.received_at: list[float] = []
        """``time.monotonic()`` at which each row was decoded."""
        self.ended = False
        self.messages = 0

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> DashboardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_message(self) -> tuple[str, Any]:
        """The next ``(event, data)``; ``StreamEnded`` at the end of the stream."""
        kind, data = "message", list[str]()
        while True:
            line = self.response.readline()
            if not line:
                raise StreamEnded("the server closed the stream")
            text = line.decode().rstrip("\r\n")
            if not text:
                if data:
                    break
                continue
            if text.startswith(":"):
                continue
            name, _, value = text.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                kind = value
            elif name == "data":
                data.append(value)
        payload = json.loads("\n".join(data))
        self._apply(kind, payload)
        return kind, payload

    def _apply(self, kind: str, payload: Any) -> None:
        self.messages += 1
        if kind == "hello":
            self.hello = payload
            self.keys = list(payload["keys"])
            self.rows, self.events = [], []
        elif kind == "keys":
            self.keys.extend(payload)
        elif kind == "rows":
            now = time.monotonic()
            for r in payload:
                values = {self.keys[i]: v for i, v in enumerate(r[2:]) if v is not None}
                self.rows.append({"step": r[0], "time": r[1], "values": values})
                self.received_at.append(now)
        elif kind == "events":
            self.events.extend(payload)
        elif kind == "end":
            self.ended = True

    def until(self, condition: Callable[[DashboardReader], bool], timeout: float = 10.0
              ) -> DashboardReader:
        """Read until ``condition(self)``; ``AssertionError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not condition(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"not reached within {timeout} s: {len(self.rows)} rows, "
                                     f"{len(self.events)} events, ended={self.ended}")
            self.next_message()
        return self
