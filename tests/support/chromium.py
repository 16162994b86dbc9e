"""Headless Chromium driven through the Chrome DevTools Protocol over a pipe.

``chromium --remote-debugging-pipe`` reads protocol messages on its file descriptor 3 and writes
them on 4, each a JSON text ended by a NUL byte: no websocket, no library beyond the standard
one, nothing on the network.  Usage::

    with Chromium() as browser:
        page = browser.open("http://127.0.0.1:8765/", width=1400, height=900)
        page.wait_for("document.body.dataset.rows > 0")
        page.screenshot(path)
        assert not page.errors()

Console errors (``console.error``, uncaught exceptions, failed loads the browser logs) are
collected from the moment the page is opened.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def chromium_path() -> str | None:
    """Debian's ``chromium`` (or ``chromium-browser``, ``google-chrome``), if installed."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class CdpError(RuntimeError):
    """The browser answered a command with an error, or did not answer in time."""


class Chromium:
    """One headless browser process (see the module docstring)."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._profile: str | None = None
        self._tx = -1
        self._rx = -1
        self._next_id = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._results: dict[int, dict[str, Any]] = {}
        self._events: list[dict[str, Any]] = []
        self._reader: threading.Thread | None = None
        self._closed = False

    def __enter__(self) -> Chromium:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        exe = chromium_path()
        if exe is None:
            raise RuntimeError("chromium is not installed")
        self._profile = tempfile.mkdtemp(prefix="gpulens-chromium-")
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()
        flags = [
            "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-default-apps", "--mute-audio", "--hide-scrollbars",
            "--force-device-scale-factor=1", "--disable-dev-shm-usage",
            f"--user-data-dir={self._profile}", "about:blank",
        ]
        # The browser wants the pipe on descriptors 3 and 4 exactly: bash puts them there.
        script = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w}'
        try:
            self._proc = subprocess.Popen(
                ["bash", "-c", script, exe, *flags], pass_fds=(to_browser_r, from_browser_w),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(to_browser_r)
            os.close(from_browser_w)
        self._tx, self._rx = to_browser_w, from_browser_r
        self._reader = threading.Thread(target=self._read, name="cdp-reader", daemon=True)
        self._reader.start()
        self.call("Browser.getVersion")

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._rx, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                raw, _, buf = buf.partition(b"\0")
                msg = json.loads(raw)
                with self._cond:
                    if "id" in msg:
                        self._results[msg["id"]] = msg
                    else:
                        self._events.append(msg)
                    self._cond.notify_all()

    def send(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None) -> int:
        """Send a command; returns its id (see :meth:`result`)."""
        with self._lock:
            self._next_id += 1
            msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
            if session is not None:
                msg["sessionId"] = session
            data = json.dumps(msg).encode() + b"\0"
            while data:
                data = data[os.write(self._tx, data):]
            return self._next_id

    def result(self, ident: int, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the answer to command ``ident``."""
        deadline = time.monotonic() + (timeout or self.timeout)
        with self._cond:
            while ident not in self._results:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise CdpError(f"no answer to command {ident}"
                                   + (" (browser gone)" if self._closed else ""))
                self._cond.wait(left)
            msg = self._results.pop(ident)
        if "error" in msg:
            raise CdpError(str(msg["error"]))
        result: dict[str, Any] = msg.get("result", {})
        return result

    def call(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        return self.result(self.send(method, params, session), timeout)

    def events(self, session: str | None = None) -> list[dict[str, Any]]:
        with self._cond:
            return [e for e in self._events if session is None or e.get("sessionId") == session]

    def open(self, url: str, width: int = 1400, height: int = 900) -> Page:
        """A new tab at ``width`` x ``height`` CSS pixels, loading ``url``."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"]
        page = Page(self, session, target)
        for domain in ("Runtime", "Log", "Page"):
            page.call(f"{domain}.enable")
        page.resize(width, height)
        page.call("Page.navigate", {"url": url})
        return page

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(Exception):
                self.send("Browser.close")
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait(10)
        for fd in (self._tx, self._rx):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._tx = self._rx = -1
        if self._reader is not None:
            self._reader.join(5)
        if self._profile is not None:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = None


class Page:
    """One tab, attached with a flat session."""

    def __init__(self, browser: Chromium, session: str, target: str) -> None:
        self.browser = browser
        self.session = session
        self.target = target

    def call(self, method: str, params: dict[str, Any] | None = None,
             timeout: float | None = None) -> dict[str, Any]:
        return self.browser.call(method, params, self.session, timeout)

    def send(self, method: str, params: dict[str, Any] | None = None) -> int:
        return self.browser.send(method, params, self.session)

    def resize(self, width: int, height: int) -> None:
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def evaluate(self, expression: str, timeout: float | None = None) -> Any:
        """The value of a JavaScript expression (promises awaited)."""
        return self._value(self.call("Runtime.evaluate", self._eval_params(expression),
                                     timeout))

    def evaluate_async(self, expression: str) -> int:
        """Start evaluating; :meth:`evaluated` waits for the value."""
        return self.send("Runtime.evaluate", self._eval_params(expression))

    def evaluated(self, ident: int, timeout: float | None = None) -> Any:
        return self._value(self.browser.result(ident, timeout))

    @staticmethod
    def _eval_params(expression: str) -> dict[str, Any]:
        return {"expression": expression, "returnByValue": True, "awaitPromise": True}

    @staticmethod
    def _value(result: dict[str, Any]) -> Any:
        if "exceptionDetails" in result:
            raise CdpError(json.dumps(result["exceptionDetails"])[:2000])
        return result.get("result", {}).get("value")

    def wait_for(self, condition: str, timeout: float = 60.0) -> Any:
        """Poll a JavaScript expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        value: Any = None
        while time.monotonic() < deadline:
            with contextlib.suppress(CdpError):
                value = self.evaluate(condition)
                if value:
                    return value
            time.sleep(0.1)
        raise AssertionError(f"not true within {timeout} s: {condition} (last: {value!r})")

    def screenshot(self, path: Path | str, full_page: bool = True) -> Path:
        """A PNG of the page (the whole page with ``full_page``)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
            size = self.evaluate("[document.documentElement.scrollWidth, "
                                 "document.documentElement.scrollHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1}
        data = self.call("Page.captureScreenshot", params)["data"]
        out = Path(path)
        out.write_bytes(base64.b64decode(data))
        return out

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and errors the browser logged for this page."""
        out: list[str] = []
        for e in self.browser.events(self.session):
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                out.append(json.dumps(params.get("exceptionDetails"))[:1000])
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error",
                                                                               "assert"):
                out.append(json.dumps(params.get("args"))[:1000])
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                out.append(json.dumps(params["entry"])[:1000])
        return out
