"""The live dashboard without a browser: its event stream read as a page reads it (history first,
then live rows), slow pages that never hold the writer up, the bounded history, alerts, the
sink's specs and where its server lives, ``gpulens serve`` (page, ``/metrics`` and ``/events``
on one port; a clear message for a port in use) and ``gpulens record --sink dashboard:PORT``.
The page itself is tested in headless Chromium (tests/test_dashboard_browser.py)."""

from __future__ import annotations

import itertools
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

import gpulens
from gpulens.dashboard import DashboardServer, PortInUse
from gpulens.log import NOTICE, logger, reset_warnings, set_verbosity
from gpulens.model import Event, GpuInfo, Row, RunContext
from gpulens.sinks import parse_sink, resolve_sink
from gpulens.sinks.dashboard import DashboardSink
from gpulens.testing import SimulatedNVML
from tests.support.sse import DashboardReader, StreamEnded

CONTEXT = RunContext(
    gpus=(GpuInfo(0, "NVIDIA H100 80GB HBM3", "GPU-0", "00000000:18:00.0", 85.9, 700.0),
          GpuInfo(1, "NVIDIA H100 80GB HBM3", "GPU-1", "00000000:2A:00.0", 85.9, 700.0)),
    hostname="node-7", backend="nvml", interval=0.1)


def row(step: int, **extra: float) -> Row:
    values = {"train/global_step": float(step), "train/loss": 5.0 / step,
              "gpu/0/sm_active_pct": 90.0 + step % 7, "gpu/1/sm_active_pct": 80.5,
              "gpu/0/power_w": 612.25, "gpu/1/power_w": 598.0, **extra}
    return Row(step=step, time=1_800_000_000.0 + step * 0.1, values=values)


def get(url: str, timeout: float = 10) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


@pytest.fixture
def server() -> Iterator[DashboardServer]:
    s = DashboardServer(port=0)
    s.start(CONTEXT)
    try:
        yield s
    finally:
        s.close()


# -- the stream --------------------------------------------------------------------------------
def test_late_page_gets_context_and_history_then_live_rows(server: DashboardServer) -> None:
    for step in range(1, 6):
        server.publish(row(step))
    with DashboardReader(server.url) as page:
        assert page.status == 200 and page.content_type.startswith("text/event-stream")
        page.until(lambda p: len(p.rows) == 5)
        assert page.hello is not None
        ctx = page.hello["context"]
        assert ctx["backend"] == "nvml" and ctx["hostname"] == "node-7"
        assert [g["name"] for g in ctx["gpus"]] == ["NVIDIA H100 80GB HBM3"] * 2
        assert [r["step"] for r in page.rows] == [1, 2, 3, 4, 5]
        assert page.rows[3]["values"] == pytest.approx(row(4).values, rel=1e-6)
        assert page.rows[3]["time"] == pytest.approx(1_800_000_000.4, abs=1e-3)
        # a live row with a key never seen: the key list grows, the row follows; absent and
        # non-finite values are absent on the page too
        server.publish(row(6, **{"perf/mfu_pct": 41.5, "gpu/1/power_w": float("nan")}))
        page.until(lambda p: len(p.rows) == 6)
        live = page.rows[-1]["values"]
        assert live["perf/mfu_pct"] == 41.5 and "gpu/1/power_w" not in live
        assert live["train/global_step"] == 6 and isinstance(live["train/global_step"], int)


def test_a_stalled_page_never_holds_up_the_writer_or_other_pages() -> None:
    server = DashboardServer(port=0, send_timeout_s=10.0)
    server.start(CONTEXT)
    stalled = socket.socket()
    try:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", server.port))
        stalled.sendall(b"GET /events HTTP/1.0\r\n\r\n")  # ... and never reads
        with DashboardReader(server.url) as page:
            page.until(lambda p: p.hello is not None)
            wide = {f"train/k{i}": 1000.0 + i / 7 for i in range(150)}  # ~1.5 KB a row
            done: list[float] = []

            def read_all() -> None:
                page.until(lambda p: len(p.rows) == 3000, timeout=240)
                done.append(time.monotonic())

            reader = threading.Thread(target=read_all)
            reader.start()
            slowest = 0.0
            for step in range(1, 3001):  # 4.5 MB: far more than the stalled page's buffers
                t0 = time.perf_counter()
                server.publish(row(step, **wide))
                slowest = max(slowest, time.perf_counter() - t0)
            reader.join(60)
            assert done, "the reading page did not get every row"
            # publish never waited on the stalled page (a send to it blocks for 10 s; the
            # bound leaves a loaded machine room)
            assert slowest < 5.0, slowest
            assert [r["step"] for r in page.rows] == list(range(1, 3001))
            # the stalled page is disconnected after the send timeout, and counted
            deadline = time.monotonic() + 60  # bounds a hang
            while server.stats.clients_dropped_slow < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            stats = server.stats
            assert stats.clients_dropped_slow == 1 and stats.clients == 1, stats
    finally:
        stalled.close()
        server.close()


def test_a_page_too_far_behind_is_disconnected_and_gets_everything_on_reconnect() -> None:
    server = DashboardServer(port=0, backlog=100)
    server.start(CONTEXT)
    slow = socket.socket()
    try:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(("127.0.0.1", server.port))
        slow.sendall(b"GET /events HTTP/1.0\r\n\r\n")
        time.sleep(0.3)  # connected, hello sent; now it reads nothing for a while
        wide = {f"train/k{i}": 1000.0 + i / 7 for i in range(150)}
        for step in range(1, 6001):  # ~9 MB, more than loopback's socket buffers
            server.publish(row(step, **wide))
        slow.settimeout(20)
        data = bytearray()
        while chunk := slow.recv(1 << 16):  # now it reads, until the server hangs up
            data += chunk
        text = data.decode()
        assert "event: end" not in text  # cut off, not ended
        got = [int(m) for m in re.findall(r"^data: \[\[(\d+),", text, re.M)]
        assert got == list(range(1, len(got) + 1)) and len(got) < 6000  # a prefix, no gap
        assert server.stats.clients_dropped_slow == 1
        # its reconnection gets the whole history
        with DashboardReader(server.url) as page:
            page.until(lambda p: len(p.rows) == 6000, timeout=120)
            assert [r["step"] for r in page.rows] == list(range(1, 6001))
    finally:
        slow.close()
        server.close()


def test_history_is_bounded_keeps_the_first_row_and_the_newest_half_whole() -> None:
    server = DashboardServer(port=0, history_rows=64)
    server.start(CONTEXT)
    try:
        for step in range(1, 1001):
            server.publish(row(step))
        stats = server.stats
        assert stats.rows == 1000 and stats.history_rows <= 64
        assert stats.thinned == 1000 - stats.history_rows
        with DashboardReader(server.url) as page:
            page.until(lambda p: len(p.rows) == stats.history_rows)
            steps = [r["step"] for r in page.rows]
        assert steps[0] == 1 and steps == sorted(set(steps))
        assert steps[-32:] == list(range(969, 1001))  # the newest half is complete
        gaps = [b - a for a, b in itertools.pairwise(steps)]
        assert gaps == sorted(gaps, reverse=True)  # older stretches are coarser
    finally:
        server.close()


def test_events_and_alert_keys_become_one_alert_history(server: DashboardServer) -> None:
    firing = Event(kind="alert", name="input_bound", state="firing", step=2, time=1.8e9,
                   message="waiting for data 41 % of the step", advice="more DataLoader workers",
                   data={"perf/data_wait_pct": 41.0, "bad": float("nan")})
    server.publish(Row(1, 1.8e9, {"alerts/input_bound": 0.0}))
    server.publish(Row(2, 1.8e9, {"alerts/input_bound": 1.0}, events=(firing,)))
    server.publish(Row(3, 1.8e9, {"alerts/input_bound": 1.0, "alerts/thermal": 1.0}))
    server.publish(Row(4, 1.8e9, {"alerts/input_bound": 0.0, "alerts/thermal": 1.0}))
    with DashboardReader(server.url) as page:
        page.until(lambda p: len(p.rows) == 4 and len(p.events) == 3)
        told = [(e["name"], e["state"], e["step"]) for e in page.events]
        assert told == [("input_bound", "firing", 2), ("thermal", "firing", 3),
                        ("input_bound", "resolved", 4)]
        first = page.events[0]
        assert first["message"] == firing.message and first["advice"] == firing.advice
        assert first["data"] == {"perf/data_wait_pct": 41.0, "bad": None}
        assert "alerts/thermal = 1" in page.events[1]["message"]
        notice = Event(kind="notice", name="gpu_lost", state="info", step=5, time=1.8e9,
                       severity="critical", message="GPU 1 stopped answering")
        server.publish(Row(5, 1.8e9, {}, events=(notice,)))
        page.until(lambda p: len(p.events) == 4)
        assert page.events[-1]["severity"] == "critical"


def test_close_ends_every_stream_and_frees_the_port(server: DashboardServer) -> None:
    server.publish(row(1))
    page = DashboardReader(server.url)
    page.until(lambda p: len(p.rows) == 1)
    server.close()
    page.until(lambda p: p.ended, timeout=5)
    with pytest.raises(StreamEnded):
        page.next_message()
    page.close()
    again = DashboardServer(port=server.port)
    again.bind()  # the port is free again
    again.close()


def test_the_page_fetches_only_its_own_files_and_other_routes(server: DashboardServer) -> None:
    status, ctype, html = get(server.url)
    assert status == 200 and ctype.startswith("text/html")
    # nothing is fetched from elsewhere: no URL with a host; the page's sheet and scripts are
    # the server's own files, each served with its type
    assert not re.search(r"https?://", html)
    fetched = re.findall(r"<(?:script|link|img)[^>]+(?:src|href)=\"(?!data:)([^\"]+)\"", html)
    assert sorted(fetched) == ["chart.js", "page.css", "page.js"]
    for name, kind in (("page.css", "text/css"), ("chart.js", "text/javascript"),
                       ("page.js", "text/javascript")):
        status, ctype, text = get(server.url + name)
        assert status == 200 and ctype.startswith(kind) and text.strip()
        assert not re.search(r"https?://", text), name
    status, _, text = get(server.url + "metrics")
    assert status == 404 and "gpulens serve" in text
    status, _, _ = get(server.url + "nothing-here")
    assert status == 404


def test_metrics_are_served_and_a_failing_provider_is_told(
        caplog: pytest.LogCaptureFixture) -> None:
    reset_warnings()
    calls: list[int] = []

    def metrics() -> tuple[bytes, str]:
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("registry broken")
        return b"gpulens_up 1\n", "text/plain; version=0.0.4"

    server = DashboardServer(port=0, metrics=metrics)
    server.start(CONTEXT)
    try:
        assert get(server.url + "metrics") == (200, "text/plain; version=0.0.4",
                                               "gpulens_up 1\n")
        with caplog.at_level("WARNING", logger="gpulens"):
            status, _, text = get(server.url + "metrics")
            get(server.url + "metrics")
        assert status == 500 and "registry broken" in text
        told = [r.getMessage() for r in caplog.records if "/metrics failed" in r.getMessage()]
        assert len(told) == 1 and "registry broken" in told[0]  # once per cause
    finally:
        server.close()


def test_too_many_pages_are_refused_with_503() -> None:
    server = DashboardServer(port=0, max_clients=2)
    server.start(CONTEXT)
    try:
        a, b = DashboardReader(server.url), DashboardReader(server.url)
        a.until(lambda p: p.hello is not None)
        b.until(lambda p: p.hello is not None)
        status, _, text = get(server.url + "events")
        assert status == 503 and "too many" in text
        assert server.stats.clients_refused == 1
        a.close()
        b.close()
    finally:
        server.close()


# -- the sink ----------------------------------------------------------------------------------
def test_sink_specs_and_registration() -> None:
    assert isinstance(resolve_sink("dashboard"), DashboardSink)
    s = DashboardSink.from_spec(None)
    assert (s.host, s.port) == ("127.0.0.1", 8765)
    s = DashboardSink.from_spec("9000")
    assert (s.host, s.port) == ("127.0.0.1", 9000)
    s = DashboardSink.from_spec("0.0.0.0:9001")
    assert (s.host, s.port) == ("0.0.0.0", 9001)
    s = DashboardSink.from_spec("[::1]:9002")
    assert (s.host, s.port, s.url) == ("::1", 9002, "http://[::1]:9002/")
    with pytest.raises(ValueError, match="expected 'dashboard', 'dashboard:PORT'"):
        resolve_sink("dashboard:web")
    with pytest.raises(ValueError, match="0-65535"):
        resolve_sink("dashboard:70000")


def test_sink_on_a_port_in_use_says_which_and_what_to_do() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        sink = DashboardSink(port=port)
        with pytest.raises(PortInUse) as err:
            sink.open(CONTEXT)
        assert str(err.value) == (
            f"dashboard sink: port {port} on 127.0.0.1 is already in use (another dashboard "
            f"or program holds it); choose another port ('dashboard:PORT'), or 'dashboard:0' "
            f"for any free one")
        # through a monitor whose engine process hosts the sink: the same words
        mon = gpulens.Monitor(backend="simulated", sinks=[f"dashboard:{port}"])
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is already in use"):
            mon.start()
        mon.stop()


def _wait_listening(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_dashboard_spec_is_built_where_it_runs() -> None:
    """By name, a spec for the engine (nothing bound or chosen here: port 0 is chosen where the
    server runs); an object stays where it was made."""
    spec = parse_sink("dashboard:0")
    assert (spec.where, spec.options) == ("engine", {"port": 0, "host": "127.0.0.1"})
    assert spec.prepared() == spec
    sink = spec.build()
    assert isinstance(sink, DashboardSink) and sink.port == 0 and sink.server is None


def test_sink_serves_from_the_engine_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/"
    mon = gpulens.Monitor(backend="simulated", interval=0.05, sinks=[f"dashboard:{port}"])
    mon.start()
    try:
        assert mon.isolation == "process"
        # the server runs in the engine process: no dashboard thread here
        assert not [t for t in threading.enumerate() if t.name == "gpulens-dashboard"]
        _wait_listening(port)  # the sink opens in the engine, off start()'s path
        page = DashboardReader(url)
        page.until(lambda p: p.hello is not None)
        assert page.hello is not None and page.hello["context"]["backend"] == "simulated"
        assert len(page.hello["context"]["gpus"]) == 2
        for step in range(1, 11):
            time.sleep(0.03)
            mon.log(step, loss=1.0 / step)
        page.until(lambda p: len(p.rows) >= 10, timeout=15)
        last = page.rows[9]["values"]
        assert last["train/loss"] == pytest.approx(0.1)
        assert "gpu/1/power_w" in last and "gpu/0/sm_active_pct" in last
    finally:
        stats = mon.stop()
    assert stats[f"dashboard:{port}"].written >= 10
    page.until(lambda p: p.ended, timeout=10)
    page.close()


def _said_addresses(caplog: pytest.LogCaptureFixture, count: int) -> list[str]:
    """The addresses gpulens said (NOTICE records), waiting until ``count`` were said."""
    deadline = time.monotonic() + 30
    while True:
        said = [m.group(1) for r in caplog.records if r.levelno == NOTICE
                for m in [re.fullmatch(r"gpulens: live dashboard on (http://\S+/)",
                                       r.getMessage())] if m]
        if len(said) >= count or time.monotonic() > deadline:
            return said
        time.sleep(0.05)


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_the_page_says_its_address_once_it_is_served(
        isolation: str, caplog: pytest.LogCaptureFixture) -> None:
    """A sink object and a sink by name (port 0: chosen where the server runs, in the engine
    process by default): each address is said once, at NOTICE, when the page is served."""
    sink = DashboardSink(port=0)
    with (caplog.at_level(logging.INFO, logger="gpulens"),
          gpulens.Monitor(backend=SimulatedNVML(gpus=1), interval=0.05,
                          sinks=[sink, "dashboard:0"], isolation=isolation)):
        said = _said_addresses(caplog, 2)
        assert len(said) == 2 and sink.url in said, said
        for url in said:
            with DashboardReader(url) as page:  # served when it was said
                page.until(lambda p: p.hello is not None)
    caplog.clear()
    level = logger.level
    set_verbosity("error")  # the user asked for errors only
    try:
        with gpulens.Monitor(backend=SimulatedNVML(gpus=1), interval=0.05,
                             sinks=["dashboard:0"], isolation=isolation) as mon:
            mon.log(1)
    finally:
        logger.setLevel(level)
    assert not [r for r in caplog.records if r.levelno == NOTICE]


def test_a_user_who_configured_no_logging_reads_the_address_on_stderr() -> None:
    code = ("import gpulens, time\n"
            "with gpulens.Monitor(interval=0.05, sinks=['dashboard:0']) as mon:\n"
            "    time.sleep(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=cli_env(1))
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"gpulens: live dashboard on http://127\.0\.0\.1:\d+/\n", proc.stderr), \
        proc.stderr


# -- gpulens serve, gpulens record --------------------------------------------------------------
def cli_env(gpus: int = 2) -> dict[str, str]:
    return dict(os.environ, GPULENS_BACKEND="simulated", GPULENS_SIMULATED_GPUS=str(gpus))


def test_serve_has_page_metrics_and_events_on_one_port() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "gpulens.cli", "serve", "--port", "0",
                             "--interval", "0.25"], stderr=subprocess.PIPE, text=True,
                            env=cli_env())
    assert proc.stderr is not None
    try:
        line = proc.stderr.readline()
        m = re.search(r"dashboard on (http://127\.0\.0\.1:\d+/), metrics on "
                      r"(http://127\.0\.0\.1:\d+/metrics)", line)
        assert m and "SIMULATED" in line, line
        base, metrics_url = m.groups()
        assert metrics_url == base + "metrics"
        status, ctype, html = get(base)
        assert status == 200 and ctype.startswith("text/html") and "gpulens" in html
        with DashboardReader(base) as page:
            page.until(lambda p: len(p.rows) >= 3, timeout=20)
            assert page.hello is not None and page.hello["title"] == "gpulens serve"
            elapsed = [r["values"]["record/elapsed_s"] for r in page.rows]
            assert elapsed == sorted(elapsed) and 0 < elapsed[0] < 5
            assert "gpu/1/power_w" in page.rows[-1]["values"]
        status, ctype, text = get(metrics_url)
        assert status == 200 and ctype.startswith("text/plain")
        assert re.search(r'^gpulens_gpu_power_watts\{gpu="1"', text, re.M)
        assert "gpulens_train" not in text and "elapsed" not in text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err


def test_serve_on_a_port_in_use_says_which_and_what_to_do() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "gpulens.cli", "serve", "--port",
                               str(port)], capture_output=True, text=True, timeout=240,
                              env=cli_env())
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"gpulens serve: error: port {port} on 127.0.0.1 is already in use (another "
        f"'gpulens serve' or program holds it); choose another with --port N, or --port 0 "
        f"for any free port")


def test_record_with_a_dashboard_sink() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpulens.cli", "record", "--quiet", "--interval", "0.25",
         "--sink", f"dashboard:{port}", "--", sys.executable, "-c",
         "import time; time.sleep(6)"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=cli_env(1))
    try:
        deadline = time.monotonic() + 30
        page: DashboardReader | None = None
        while page is None:
            try:
                page = DashboardReader(f"http://127.0.0.1:{port}/")
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "no dashboard"
                time.sleep(0.1)
        with page:
            page.until(lambda p: len(p.rows) >= 3, timeout=20)
            values: dict[str, Any] = page.rows[-1]["values"]
            assert "gpu/0/util_pct" in values
            page.until(lambda p: p.ended, timeout=120)  # the command ended: the run ended
    finally:
        _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert f"gpulens: live dashboard on http://127.0.0.1:{port}/\n" in err
