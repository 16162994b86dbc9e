"""Dropped means stopped (issue 18): a running ``Monitor`` that nobody holds any more is
garbage-collected, and its finalizer writes its rows and ends its engine, on every transport.
Nothing gpulens holds while a monitor runs refers back to the monitor."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path

import psutil
import pytest

import gpulens
from tests.support.jsonl import read_rows


def _engine_threads() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name.startswith(("gpulens-sampler", "gpulens-sink"))]


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_monitor_dropped_without_stop_writes_its_rows_and_ends_its_engine(
        tmp_path: Path, isolation: str) -> None:
    path = tmp_path / "gpu.jsonl"
    mon = gpulens.Monitor(interval=0.05, sinks=[f"jsonl:{path}"], backend="simulated",
                          isolation=isolation).start()
    for step in range(1, 4):
        time.sleep(0.03)
        mon.log(step, loss=1.0 / step)
    pid = mon._transport.pid if isolation == "process" else None  # type: ignore[union-attr]
    collected = threading.Event()
    ref = weakref.ref(mon, lambda _: collected.set())
    del mon
    gc.collect()
    assert collected.is_set() and ref() is None  # nothing of gpulens's kept it alive
    if pid is not None:
        _, alive = psutil.wait_procs([psutil.Process(pid)] if psutil.pid_exists(pid) else [],
                                     timeout=15)
        assert not alive, "the engine process outlived its monitor"
    deadline = time.monotonic() + 15
    while _engine_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _engine_threads() == []
    assert [r["step"] for r in read_rows(path)] == [1, 2, 3]


def test_a_stopped_monitor_leaves_no_finalizer_behind(tmp_path: Path) -> None:
    mon = gpulens.Monitor(interval=0.05, sinks=[f"jsonl:{tmp_path / 'g.jsonl'}"],
                          backend="simulated").start()
    finalizer = mon._finalizer
    assert finalizer is not None and finalizer.alive
    mon.stop()
    assert not finalizer.alive  # stop() detached it: collecting it later does nothing
