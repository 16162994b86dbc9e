"""The live dashboard page in headless Chromium (Chrome DevTools Protocol over a pipe,
tests/support/chromium.py): charts have data from a real monitor run on simulated GPUs, a row
written after the page opened is on it within 1 s, MFU/throughput charts come only with their
keys, the advice panel shows alerts, ranges select rows, a ``record`` run is drawn on elapsed
time, the page fits 700 px and 1400 px, and the console stays free of errors.

Screenshots go to the test's temporary folder, and to ``$GPULENS_SCREENSHOTS`` when set."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import gpulens
from gpulens.dashboard import DashboardServer
from gpulens.model import Event, GpuInfo, Row, RunContext
from gpulens.sinks.dashboard import DashboardSink
from gpulens.testing import MemorySink, SimulatedNVML
from tests.support.chromium import Chromium, Page, chromium_path

STEPS = 30


@pytest.fixture(scope="module")
def browser() -> Iterator[Chromium]:
    if chromium_path() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing in CI (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    with Chromium() as b:
        yield b


@dataclass
class Run:
    monitor: gpulens.Monitor
    sink: DashboardSink
    rows: MemorySink

    def next_row(self, **values: float) -> Row:
        """A row like the run's last, one step on, with ``values`` changed."""
        last = self.rows.rows[-1]
        step = last.step + 1
        self.rows.rows.append(Row(step, time.time(), {**last.values, **values,
                                                      "train/global_step": float(step)}))
        return self.rows.rows[-1]


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    """A monitor on 2 simulated GPUs that logged STEPS steps into a dashboard sink.  The engine
    runs in a thread here so that the test can hand the server rows of its own (the page in
    the engine process is tested in test_dashboard_server.py)."""
    sink, rows = DashboardSink(port=0), MemorySink()
    monitor = gpulens.Monitor(backend=SimulatedNVML(gpus=2), interval=0.05, sinks=[sink, rows],
                              isolation="thread")
    monitor.start()
    try:
        for step in range(1, STEPS + 1):
            time.sleep(0.04)
            monitor.log(step, loss=6.0 * math.exp(-step / 12) + 0.2,
                        learning_rate=3e-4 * min(1.0, step / 10), grad_norm=2.0 / step ** 0.5)
        deadline = time.monotonic() + 20
        while len(rows.rows) < STEPS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(rows.rows) == STEPS
        assert sink.server is not None
        while sink.server.stats.rows < STEPS and time.monotonic() < deadline:
            time.sleep(0.05)
        yield Run(monitor, sink, rows)
    finally:
        monitor.stop()


def state(page: Page) -> dict[str, Any]:
    value: dict[str, Any] = page.evaluate("window.gpulens.state()")
    return value


def keep(shot: Path) -> None:
    """Copy a screenshot to $GPULENS_SCREENSHOTS (to look at), when set."""
    out = os.environ.get("GPULENS_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(out) / shot.name)


def no_errors(page: Page) -> None:
    assert page.errors() == []
    assert state(page)["errors"] == []


def test_charts_have_data_and_a_new_row_is_on_the_page_within_1s(
        browser: Chromium, run: Run, tmp_path: Path) -> None:
    page = browser.open(run.sink.url, width=1400, height=900)
    page.wait_for(f"document.body.dataset.rows == {STEPS}")
    st = state(page)
    charts = st["charts"]
    for chart in ("loss", "lr", "gn", "st", "eps", "cpu"):
        assert charts[chart]["points"] == STEPS, (chart, charts.get(chart))
    for chart in ("sm", "tensor", "util", "mem", "power", "temp", "clock"):
        assert charts[chart]["series"] == 2 and charts[chart]["points"] == 2 * STEPS, chart
    assert charts["loss"]["section"] == "overview" and charts["sm"]["section"] == "overview"
    assert "mfu" not in charts and "tps" not in charts  # absent keys, no chart
    assert st["xmode"] == "step"
    header = page.evaluate("document.querySelector('header').innerText")
    assert "Simulated H100 80GB HBM3" in header and "backend: simulated" in header
    assert page.evaluate("!document.getElementById('banner').hidden")
    assert "Simulated GPUs" in page.evaluate("document.getElementById('banner').innerText")

    # a row written now is drawn (how soon, against the 1 s bound: benchmarks/unit_timings.py)
    new = run.next_row(**{"train/loss": 0.123})
    waiting = page.evaluate_async(
        "new Promise((resolve) => { const check = () => {"
        f"  if (document.body.dataset.lastStep === '{new.step}' && document.querySelector("
        "     '[data-chart=loss] .now').textContent === '0.123') resolve(true);"
        "  else setTimeout(check, 5); }; check(); })")
    t0 = time.monotonic()
    run.sink.write(new)
    assert page.evaluated(waiting, timeout=10) is True
    took = time.monotonic() - t0
    print(f"row to page: {took * 1e3:.0f} ms")

    # MFU and throughput come with their keys
    run.sink.write(run.next_row(**{"perf/mfu_pct": 38.5, "perf/tokens_per_s": 125_000.0}))
    page.wait_for("(window.gpulens.state().charts.mfu || {}).points >= 1 && "
                  "(window.gpulens.state().charts.tps || {}).points >= 1")
    assert state(page)["charts"]["mfu"]["section"] == "overview"
    page.wait_for("document.querySelector('[data-chart=mfu] .now').textContent === '38.50'")

    # hovering a chart tells the values at the step under the pointer
    box = page.evaluate("(() => { const r = document.querySelector('[data-chart=sm] canvas')"
                        ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2];"
                        " })()")
    page.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": box[0], "y": box[1]})
    page.wait_for("!document.querySelector('[data-chart=sm] .tip').hidden")
    tip = page.evaluate("document.querySelector('[data-chart=sm] .tip').innerText")
    assert re.search(r"^step \d+ · ", tip) and "GPU 0: " in tip and "GPU 1: " in tip, tip
    wide = page.screenshot(tmp_path / "dashboard-1400.png")
    keep(wide)
    page.resize(700, 900)
    page.wait_for("document.documentElement.clientWidth === 700")
    time.sleep(0.3)  # a redraw at the new width
    sizes = page.evaluate(
        "({scroll: document.documentElement.scrollWidth, charts: [...document.querySelectorAll("
        "'.chart')].map((c) => c.getBoundingClientRect().width)})")
    assert sizes["scroll"] <= 700, "the page scrolls sideways at 700 px"
    assert min(sizes["charts"]) >= 300, sizes["charts"]
    narrow = page.screenshot(tmp_path / "dashboard-700.png")
    keep(narrow)
    assert wide.stat().st_size > 20_000 and narrow.stat().st_size > 20_000
    no_errors(page)


def test_the_advice_panel_shows_alerts_and_their_history(browser: Chromium, run: Run,
                                                        tmp_path: Path) -> None:
    page = browser.open(run.sink.url, width=1000, height=900)
    page.wait_for(f"document.body.dataset.rows >= {STEPS}")
    before = page.evaluate("document.getElementById('active').innerText")
    # nothing fires yet (the engine's notices, such as the energy counter's period, may be in
    # the history already)
    assert "No advice so far" in before or "Nothing is firing now" in before, before
    count = int(page.evaluate("document.getElementById('nevents').textContent") or 0)
    step = run.rows.rows[-1].step + 1
    firing = Event(kind="alert", name="input_bound", state="firing", step=step, time=time.time(),
                   message="waiting for data 41 % of the step (threshold 20 %)",
                   advice="more DataLoader workers (num_workers), pin_memory=True")
    run.sink.write(Row(step, time.time(), {"train/global_step": float(step),
                                           "alerts/input_bound": 1.0}, events=(firing,)))
    page.wait_for("!!document.querySelector('#active .alert[data-rule=input_bound]')")
    text = page.evaluate("document.getElementById('active').innerText")
    assert "input bound: waiting for data 41 % of the step" in text
    assert "Try: more DataLoader workers" in text and f"since step {step}" in text
    keep(page.screenshot(tmp_path / "dashboard-alert.png", full_page=False))
    resolved = Event(kind="alert", name="input_bound", state="resolved", step=step + 1,
                     time=time.time(), message="waiting for data 3 %")
    run.sink.write(Row(step + 1, time.time(), {"train/global_step": float(step + 1),
                                               "alerts/input_bound": 0.0},
                       events=(resolved,)))
    page.wait_for(f"document.getElementById('nevents').textContent === '{count + 2}'")
    assert "Nothing is firing now" in page.evaluate("document.getElementById('active').innerText")
    history = page.evaluate("document.getElementById('events').textContent")
    assert history.index("resolved") < history.index("firing")  # newest first
    no_errors(page)


def test_ranges_and_a_record_drawn_on_elapsed_time(browser: Chromium, tmp_path: Path) -> None:
    server = DashboardServer(port=0)
    server.start(RunContext(gpus=(GpuInfo(0, "NVIDIA H200", "GPU-x", "0:0", 150.0, 700.0),),
                            hostname="node", backend="nvml", interval=0.25))
    t0 = time.time() - 1200
    for i in range(241):  # a `gpulens record` of 20 minutes, a row every 5 s
        server.publish(Row(i + 1, t0 + 5 * i, {
            "record/elapsed_s": 5.0 * i, "gpu/0/util_pct": 50 + 40 * math.sin(i / 9),
            "gpu/0/power_w": 400 + 200 * math.sin(i / 9), "gpu/0/power_limit_w": 700.0}))
    try:
        page = browser.open(server.url, width=1400, height=900)
        page.wait_for("document.body.dataset.rows == 241")
        st = state(page)
        assert st["xmode"] == "elapsed" and st["charts"]["util0"]["points"] == 241
        assert "time since the start" in page.evaluate("document.getElementById('xinfo')"
                                                       ".innerText")
        assert page.evaluate("document.getElementById('banner').hidden")  # real GPUs
        page.evaluate("document.querySelector('button[data-range=\"300\"]').click()")
        page.wait_for("window.gpulens.state().charts.util0.points === 61")  # the last 300 s
        keep(page.screenshot(tmp_path / "dashboard-record-5min.png", full_page=False))
        page.evaluate("document.querySelector('button[data-range=\"Infinity\"]').click()")
        page.wait_for("window.gpulens.state().charts.util0.points === 241")
        # tick labels of an axis are distinct, whatever its range
        for lo, hi in ((4.705, 4.725), (1e-6, 5e-5), (1.2e6, 1.31e6), (0, 100), (0, 0.0035),
                       (0.5, 0.52), (12_000, 47_000)):
            labels = page.evaluate(f"window.gpulens.tickLabels({lo}, {hi}, 4)")
            assert len(labels) >= 2 and len(set(labels)) == len(labels), (lo, hi, labels)
        server.close()
        page.wait_for("document.getElementById('status-text').textContent.includes('run ended')")
        no_errors(page)
    finally:
        server.close()
    assert json.dumps(st)  # the state is plain data


def test_serve_prints_its_address_once_a_page_opened_then_shows_data_within_1s(
        browser: Chromium, tmp_path: Path) -> None:
    """``gpulens serve`` prints the dashboard's address; a page opened at once has charts with
    data within 1 s of its opening, measured by the page itself (navigation start to its first
    drawing with rows: ``performance.now()``, so the test's own polling does not count)."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "gpulens.cli", "serve", "--port", "0"],
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, GPULENS_BACKEND="simulated",
                                     GPULENS_SIMULATED_GPUS="2"))
    assert proc.stderr is not None
    try:
        line = proc.stderr.readline()
        found = re.search(r"dashboard on (http://127\.0\.0\.1:\d+/)", line)
        assert found, line
        page = browser.open(found.group(1), width=1400, height=900)
        first_ms = page.wait_for("window.gpulens && window.gpulens.state().firstDataMs",
                                 timeout=30)
        print(f"page opened to first data: {first_ms} ms")
        assert first_ms < 1000, f"first data {first_ms} ms after the page opened"
        charts = state(page)["charts"]
        assert charts["power"]["series"] == 2
        # ticks of a clock, not training steps: no training panel (step time, loss ...)
        assert not [c for c in charts.values() if c["section"] == "training"], charts
        shot = page.screenshot(tmp_path / "serve-first-data.png", full_page=False)
        keep(shot)
        no_errors(page)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
