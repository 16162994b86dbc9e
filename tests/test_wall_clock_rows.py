"""Advice only from evidence that supports it: rows that ``gpulens serve`` and ``record`` write
are ticks of a clock, not training steps.  The engine knows it (``Monitor(wall_clock=True)``):
those rows carry no per-step figures and only the rules about the hardware judge them, while a
training run with a slow loader still gets ``input_bound``, said in one WARNING line."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

import gpulens
from gpulens.engine.rules import RULES, RuleEngine, RulesConfig
from gpulens.integrations.phases import StepPhases
from gpulens.testing import Constant, MemorySink, SimulatedNVML
from tests.support.sse import DashboardReader

ROWS = 60
"""``gpulens serve`` runs 60 s in the issue, one row a second.  The rules count rows, not
seconds: a 20-row warm-up, then evidence of 10 rows covering at least 2 s.  So 60 rows 0.1 s
apart give them what the minute gives: 60 wall-clock ticks, over 6 s in which the simulated
load (0.55 +- 0.4, a 7 s wave) spends more than 2 s below input_bound's 70 % utilization, with
0.03-0.07 s "idle per step" in every tick: what made input_bound fire on serve before."""

TRAINING_KEYS = re.compile(r"^(train/|perf/)")
"""What the dashboard's training section charts (loss, learning rate, gradient norm, step time,
data wait, TFLOP/s)."""


def test_serve_with_no_training_gives_no_advice_no_warning_and_no_training_figures() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpulens.cli", "serve", "--port", "0", "--interval", "0.1"],
        stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, GPULENS_BACKEND="simulated", GPULENS_SIMULATED_GPUS="2"))
    assert proc.stderr is not None
    try:
        line = proc.stderr.readline()
        found = re.search(r"dashboard on (http://127\.0\.0\.1:\d+/)", line)
        assert found, line
        with DashboardReader(found.group(1)) as page:
            page.until(lambda p: len(p.rows) >= ROWS, timeout=120)
            rows: list[dict[str, Any]] = page.rows
            events = list(page.events)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "WARNING" not in line + err, line + err
    assert not [e for e in events if e["kind"] == "alert"], events
    firing = {k for r in rows for k, v in r["values"].items() if k.startswith("alerts/") and v}
    assert not firing, firing
    # only the rules about the hardware judged these rows
    judged = {k for r in rows for k in r["values"] if k.startswith("alerts/")}
    assert judged <= {"alerts/power_capped", "alerts/thermal"}, judged
    assert not {k for r in rows for k in r["values"] if TRAINING_KEYS.match(k)}
    elapsed = [r["values"]["record/elapsed_s"] for r in rows]
    assert elapsed == sorted(elapsed) and elapsed[ROWS - 1] >= 0.1 * (ROWS - 2)
    assert all("gpu/1/power_w" in r["values"] for r in rows[1:])


def test_wall_clock_rows_are_judged_by_the_hardware_rules_only() -> None:
    assert {n for n, s in RULES.items() if not s.training} == {"power_capped", "thermal"}
    assert set(RuleEngine(RulesConfig(training=False)).rules) == {"power_capped", "thermal"}
    assert set(RuleEngine(RulesConfig()).rules) == set(RULES)
    sink = MemorySink()
    with gpulens.Monitor(interval=0.02, sinks=[sink], wall_clock=True,
                         backend=SimulatedNVML(gpus=1, load=Constant(0.2))) as mon:
        for tick in range(1, 31):
            time.sleep(0.02)
            mon.log(tick, **{"record/elapsed_s": tick * 0.02})
    assert [r.step for r in sink.rows] == list(range(1, 31))
    for row in sink.rows:
        assert not {k for k in row.values if TRAINING_KEYS.match(k)} - {"train/global_step"}
        assert "train/global_step" not in row.values and "gpu/0/util_pct" in row.values
        assert not [e for e in row.events if e.kind == "alert"]


def test_training_with_a_slow_loader_gets_input_bound_in_one_warning_line(
        caplog: pytest.LogCaptureFixture) -> None:
    """A plain loop whose batches take 30 ms to load and 10 ms to compute (its step phases
    marked as the callbacks mark them): input_bound fires once the 20-step warm-up is past; the
    WARNING is one line, and the rest (what was seen, what to try) follows at INFO and is in
    the row's event."""
    sink = MemorySink()
    phases = StepPhases()
    with (caplog.at_level(logging.INFO, logger="gpulens"),
          gpulens.Monitor(interval=0.02, sinks=[sink], isolation="thread",
                          backend=SimulatedNVML(gpus=1, load=Constant(0.9))) as mon):
        for step in range(1, 31):
            phases.resume()
            time.sleep(0.03)  # the loader
            phases.step_begin()
            time.sleep(0.01)  # forward, backward, optimizer
            phases.step_end()
            mon.log(step, loss=1.0 / step, **phases.collect(1))
    fired = [e for r in sink.rows for e in r.events
             if e.kind == "alert" and e.name == "input_bound" and e.state == "firing"]
    assert len(fired) == 1 and 20 <= fired[0].step <= 30, [e.step for e in fired]
    assert "DataLoader workers" in fired[0].advice
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    (warning,) = [m for m in warnings if "input_bound" in m]
    assert "\n" not in warning and "Try:" not in warning and len(warning) < 200, warning
    assert warning.startswith(f"gpulens: input_bound at step {fired[0].step}: input-bound: "
                              "the GPUs wait for data")
    details = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO
               and r.getMessage().startswith("gpulens: input_bound at step")]
    assert len(details) == 1 and "Try: Feed the GPUs faster" in details[0]
