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


PLAIN_LOOP_THAT_RAISES = '''
import time, wandb, gpulens
run = wandb.init(project="gpulens-test")
mon = gpulens.Monitor(interval=0.05, sinks=["wandb"], backend="simulated").start()
for step in range(1, 21):
    time.sleep(0.05)
    wandb.log({"loss": 1.0 / step}, step=step)
    mon.log(step)
raise RuntimeError("boom at step 20")   # no stop(), no wandb.finish()
'''


def test_a_plain_loop_that_raises_still_gets_its_rows_into_wandb(
        tmp_path: Path, wandb_offline: Path) -> None:
    """The monitor's own exit hook is registered at ``start()``, after ``wandb.init``'s, so it
    runs first (``atexit``: newest first) while W&B's service still takes rows (registered
    when the process made its first finalizer, it ran after W&B's: 12 of 20 rows lost)."""
    from tests.support.wandb_reader import run_script_that_raises

    stderr, history = run_script_that_raises(tmp_path, PLAIN_LOOP_THAT_RAISES, wandb_offline,
                                             "boom at step 20")
    assert "dropped" not in stderr and "lost" not in stderr, stderr
    assert [h["_step"] for h in history if "loss" in h] == list(range(1, 21))
    assert sorted(h["gpulens/step"] for h in history if "gpulens/step" in h) == list(
        range(1, 21))
