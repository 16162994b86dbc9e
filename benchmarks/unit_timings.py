"""The wall-clock figures that unit tests used to assert, measured here beside a reference
arm in the same run (issue 20: a unit test waits on events and never asserts a time; on a
loaded machine with the suite in several workers, a 50 ms bound fails on a scheduler's whim).

Each scenario prints its figure, the reference measured side by side, their ratio, and checks
the bound the unit test used to assert (``check`` column: ``ok`` / ``FAILED``); the script
exits 1 when a check fails. Scenarios (the test each came from):

- ``log() with the engine process killed`` (tests/test_transport_process.py,
  ``test_engine_process_killed_mid_run_training_goes_on``): worst ``log()`` after the engine
  process was killed, beside ``log()`` while it lives; bound 50 ms. Also ``stop()`` after the
  death, beside a normal ``stop()``; bound 5 s.
- ``log() with the MLflow server gone`` (tests/test_faults.py,
  ``test_mlflow_server_gone_mid_run``): worst ``log()`` after the tracking server stopped,
  beside ``log()`` while it answers; bound 50 ms. ``stop(timeout=3)`` then; bound 15 s.
- ``forked child's exit`` (``test_a_forked_child_leaves_the_parents_sampler_alone``): a child
  forked from a process whose monitor runs exits, beside a fork of a process without one;
  bound 1.5 s.
- ``latest() when the engine process dies`` (``test_latest_gives_up_at_once_...``): how long
  ``latest()`` waits when the engine process is killed 0.3 s into its 2 s wait, beside an
  answered ``latest()``; bound 1.5 s.
- ``MergingLogger two calls a step`` (tests/test_integration_verl.py,
  ``test_two_calls_at_one_step_do_not_stall``): worst ``log()`` of verl's logger when training
  and validation log at one step, beside one call a step, from step 2 on (the first call
  starts the monitor); bound 0.5 s.
- ``W&B sink write() with alerts`` (tests/test_tracker_layout.py,
  ``test_wandb_alerts_are_sent_and_charted``): worst ``write()`` of rows carrying alerts
  (``run.alert``, offline: a message to wandb-core), beside rows without; bound 0.5 s.
- ``row finished after its log()`` (tests/test_monitor.py,
  ``test_rows_come_soon_after_log``): the median time from ``log()`` to its row in a sink,
  interval 0.5 s, both isolations, beside the interval (the next once-a-second read would
  take longer); bound 0.6 s.
- ``dashboard row until drawn`` (tests/test_dashboard_browser.py,
  ``test_charts_have_data_and_a_new_row_is_on_the_page_within_1s``): a row written into a
  dashboard sink until headless Chromium has drawn it, beside a row until a stream reader in
  this process decoded it; bound 1 s. Skipped without Chromium.
- ``record tail, first read`` (tests/test_watch_record.py,
  ``test_the_first_read_is_bounded_to_the_end_of_a_long_record``): the first poll of a 2 MiB
  record (64 KiB read), beside the first poll of a one-row record; bound 0.5 s.

    .venv/bin/python benchmarks/unit_timings.py            # every scenario, 3 rounds
    .venv/bin/python benchmarks/unit_timings.py --quick    # one short round, exit 0 (smoke)

``--quick`` is a smoke run: one round, ``row finished after its log()`` once per isolation,
the MLflow server (on files, not SQLite) starts in the background while the other scenarios
run and is killed rather than stopped, and the monitor's stop after it has a 1 s timeout
(``stop(timeout=1)``): its figures are no measurement.

Needs ``mlflow`` for its scenario (skipped with a line saying so without it). Writes
``$OUT/unit_timings.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

import psutil  # noqa: E402

import gpulens  # noqa: E402
from gpulens.testing import MemorySink, SimulatedNVML  # noqa: E402


class Figure:
    """One line of the table: the figure, its reference, and the bound it is checked on."""

    def __init__(self, name: str, value_s: float, reference_s: float, bound_s: float) -> None:
        self.name, self.value_s, self.reference_s, self.bound_s = (
            name, value_s, reference_s, bound_s)

    @property
    def ok(self) -> bool:
        return self.value_s < self.bound_s

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value_s": self.value_s, "reference_s": self.reference_s,
                "bound_s": self.bound_s, "ok": self.ok}


def _timed(call: Callable[[], Any]) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def _log_times(mon: gpulens.Monitor, steps: range, dt: float) -> list[float]:
    out = []
    for step in steps:
        time.sleep(dt)
        out.append(_timed(lambda s=step: mon.log(s, loss=1.0)))
    return out


def _engine_pid(mon: gpulens.Monitor) -> int:
    pid = mon._transport.pid  # type: ignore[union-attr]
    assert pid is not None
    return int(pid)


def _wait(predicate: Callable[[], Any], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting")
        time.sleep(0.01)


def engine_killed(steps: int) -> list[Figure]:
    # the reference: log() and stop() while the engine process lives
    sink = MemorySink()
    mon = gpulens.Monitor(interval=0.05, sinks=[sink], backend="simulated").start()
    alive = _log_times(mon, range(1, steps + 1), 0.01)
    normal_stop = _timed(mon.stop)
    # the figure: the same after the engine process was killed
    sink = MemorySink()
    mon = gpulens.Monitor(interval=0.05, sinks=[sink], backend="simulated").start()
    _log_times(mon, range(1, 4), 0.03)
    _wait(lambda: len(sink.rows) == 3)
    child = psutil.Process(_engine_pid(mon))
    child.kill()
    child.wait(5)
    dead = _log_times(mon, range(4, 4 + steps), 0.01)
    dead_stop = _timed(mon.stop)
    return [Figure("log() worst, engine process killed", max(dead), max(alive), 0.05),
                Figure("stop() after the engine process died", dead_stop, normal_stop, 5.0)]


def mlflow_installed() -> bool:
    try:
        import mlflow  # noqa: F401
    except ImportError:
        print("mlflow is not installed: its scenario is skipped")
        return False
    return True


def start_server_early(root: Path) -> Future[Any]:
    """``--quick``: the MLflow server of :func:`mlflow_down` starting in the background while
    the other scenarios run (its start is most of a smoke run's time), on files rather than
    SQLite (no schema migrations at start). Its CPU disturbs their figures: a smoke run's."""
    from tests.support.mlflow_server import start_mlflow_server

    pool = ThreadPoolExecutor(1, thread_name_prefix="mlflow-server-start")
    future = pool.submit(start_mlflow_server, root, file_store=True)
    pool.shutdown(wait=False)
    return future


def mlflow_down(steps: int, early: Future[Any] | None = None) -> list[Figure]:
    """``early`` (``--quick``): the server from :func:`start_server_early`, killed at once
    rather than stopped (uvicorn's graceful shutdown takes seconds), and ``stop(timeout=1)``
    rather than 3 (the stop waits its timeout out: the server is gone)."""
    from mlflow import MlflowClient

    from gpulens.sinks import sink_spec
    from tests.support.mlflow_server import start_mlflow_server

    with tempfile.TemporaryDirectory() as root:
        server = early.result() if early is not None else start_mlflow_server(Path(root))
        end = server.kill if early is not None else server.stop
        timeout = 1.0 if early is not None else 3.0
        try:
            client = MlflowClient(server.uri)
            run_id = client.create_run("0").info.run_id
            sink = sink_spec("mlflow", run_id=run_id, tracking_uri=server.uri)  # engine side
            mon = gpulens.Monitor(interval=0.05, backend=SimulatedNVML(gpus=1),
                                  sinks=[sink]).start()
            up = _log_times(mon, range(1, steps + 1), 0.02)
            _wait(lambda: len(client.get_metric_history(run_id, "train/gpu_power_w_mean"))
                  == steps)
            end()
            down = _log_times(mon, range(steps + 1, 2 * steps + 1), 0.02)
            down_stop = _timed(lambda: mon.stop(timeout=timeout))
        finally:
            end()
    return [Figure("log() worst, MLflow server gone", max(down), max(up), 0.05),
            Figure(f"stop(timeout={timeout:g}), MLflow server gone", down_stop, timeout, 15.0)]


_FORK = textwrap.dedent("""
    import os, sys, time, gpulens
    mon = None
    if sys.argv[1] == "monitor":
        mon = gpulens.Monitor(interval=0.05, sinks=[], backend="simulated").start()
        for step in range(1, 4):
            time.sleep(0.03)
            mon.log(step)
    t = time.monotonic()
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # atexit: the monitor's finalizer
    os.waitpid(pid, 0)
    print(time.monotonic() - t, flush=True)
    if mon is not None:
        mon.stop()
""")


def fork_exit() -> list[Figure]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                                         os.environ.get("PYTHONPATH", "")])}

    def child_exit(mode: str) -> float:
        done = subprocess.run([sys.executable, "-c", _FORK, mode], env=env, check=True,
                              capture_output=True, text=True, timeout=120)
        return float(done.stdout.split()[-1])

    return [Figure("forked child's exit, a monitor running", child_exit("monitor"),
                   child_exit("none"), 1.5)]


def latest_on_death() -> list[Figure]:
    mon = gpulens.Monitor(interval=0.05, backend="simulated").start()
    try:
        _wait(mon.latest)
        answered = _timed(mon.latest)
        child = psutil.Process(_engine_pid(mon))
        child.suspend()
        killer = threading.Timer(0.3, child.kill)
        killer.start()
        waited = _timed(mon.latest)
        killer.join()
    finally:
        mon.stop()
    return [Figure("latest() when the engine process dies 0.3 s in", waited, answered, 1.5)]


def verl_two_calls(steps: int) -> list[Figure]:
    from gpulens.integrations.verl import MergingLogger

    class Recorder:
        def log(self, data: dict[str, Any], step: int) -> None:
            pass

        def finish(self) -> None:
            pass

    on = {"trainer": {"enable_gpu_monitoring": True, "gpu_monitor_interval": 0.05}}
    os.environ.setdefault("GPULENS_BACKEND", "simulated")

    def worst(kinds: tuple[str, ...]) -> float:
        logger = MergingLogger.from_config(Recorder(), on)
        times = []
        for step in range(1, steps + 1):
            time.sleep(0.05)
            for kind in kinds:
                took = _timed(lambda k=kind, s=step: logger.log(
                    data={f"{k}/loss": float(s)}, step=s))
                if step > 1:  # the first call starts the monitor (an engine process)
                    times.append(took)
        logger.close()
        return max(times)

    return [Figure("verl log() worst, two calls a step", worst(("train", "val")),
                   worst(("train",)), 0.5)]


def _jsonl_rows(path: Path) -> int:
    """Rows in a JSONL record so far (lines with a step; the header has none)."""
    try:
        return sum(1 for line in path.read_text().splitlines() if '"step"' in line)
    except OSError:
        return 0


def row_lag(steps: int) -> list[Figure]:
    """How long after ``log()`` its row is written, interval 0.5 s: the driver's buffers are
    read early for a mark, not at the next once-a-second read.  The row is watched in a sink
    the engine writes itself (JSONL): a sink in the training process gets its rows back at the
    next ``log()`` (``ProcessTransport.take_rows``), which this loop does not make."""
    lags = []
    with tempfile.TemporaryDirectory() as root:
        for isolation in ("process", "thread"):
            path = Path(root) / f"{isolation}.jsonl"
            with gpulens.Monitor(interval=0.5, sinks=[f"jsonl:{path}"],
                                 backend=SimulatedNVML(gpus=1), isolation=isolation) as mon:
                for step in range(1, steps + 1):
                    time.sleep(0.35)
                    mon.log(step)
                    t = time.monotonic()
                    _wait(lambda s=step, p=path: _jsonl_rows(p) >= s, timeout=10)
                    lags.append(time.monotonic() - t)
    return [Figure("row finished after its log(), interval 0.5 s (median)",
                   statistics.median(lags), 0.5, 0.6)]


def dashboard_page() -> list[Figure]:
    """A row written into a dashboard sink until the page in headless Chromium has drawn it,
    beside the same kind of row until a stream reader in this process decoded it."""
    from tests.support.chromium import Chromium, chromium_path
    from tests.support.sse import DashboardReader

    if chromium_path() is None:
        print("chromium is not installed: the dashboard page scenario is skipped")
        return []
    from gpulens.model import Row
    from gpulens.sinks.dashboard import DashboardSink

    sink, rows = DashboardSink(port=0), MemorySink()
    mon = gpulens.Monitor(backend=SimulatedNVML(gpus=2), interval=0.05, sinks=[sink, rows],
                          isolation="thread").start()
    try:
        for step in range(1, 6):
            time.sleep(0.04)
            mon.log(step, loss=1.0)
        _wait(lambda: len(rows.rows) == 5)
        last = rows.rows[-1]

        def row(step: int, loss: float) -> Row:
            return Row(step, time.time(), {**last.values, "train/loss": loss,
                                           "train/global_step": float(step)})

        with DashboardReader(sink.url) as reader:
            reader.until(lambda r: len(r.rows) >= 5, timeout=60)
            t0 = time.monotonic()
            sink.write(row(6, 0.5))
            reader.until(lambda r: r.rows[-1]["step"] == 6, timeout=60)
            decoded = time.monotonic() - t0
        with Chromium(timeout=120) as browser:
            page = browser.open(sink.url)
            page.wait_for("document.body.dataset.lastStep === '6'", timeout=120)
            waiting = page.evaluate_async(
                "new Promise((resolve) => { const check = () => {"
                "  if (document.body.dataset.lastStep === '7' && document.querySelector("
                "     '[data-chart=loss] .now').textContent === '0.123') resolve(true);"
                "  else setTimeout(check, 5); }; check(); })")
            t0 = time.monotonic()
            sink.write(row(7, 0.123))
            page.evaluated(waiting, timeout=120)
            drawn = time.monotonic() - t0
    finally:
        mon.stop()
    return [Figure("dashboard row until drawn in Chromium", drawn, decoded, 1.0)]


def record_tail() -> list[Figure]:
    from gpulens.report.tail import RecordTail

    def first_poll(rows: int) -> float:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "r.jsonl"
            with path.open("w") as f:
                f.write(json.dumps({"event": "run_start", "run_id": "a", "time": 0.0,
                                "hostname": "n1", "backend": "nvml", "interval": 0.5,
                                "gpus": [], "meta": {}}) + "\n")
                for s in range(1, rows + 1):
                    f.write(json.dumps({"run_id": "a", "step": s, "time": float(s),
                                        "train/loss": 1.0, "gpu/0/power_w": 300.0}) + "\n")
            tail = RecordTail(path, initial_bytes=64 << 10)
            took = _timed(tail.poll)
            return took

    return [Figure("record tail, first poll of a 20000-row record", first_poll(20_000),
                   first_poll(1), 0.5)]


def wandb_alerts(quick: bool = False) -> list[Figure]:
    """``quick``: W&B does not list the installed packages into the runs (~0.3 s of CPU at
    each ``init``)."""
    try:
        import wandb
    except ImportError:
        print("wandb is not installed: its scenario is skipped")
        return []
    from gpulens.model import Event, GpuInfo, Row, RunContext
    from gpulens.sinks.wandb import WandbSink

    lean = wandb.Settings(x_save_requirements=False) if quick else None
    context = RunContext(gpus=(GpuInfo(index=0, name="NVIDIA H100 80GB HBM3", uuid="GPU-0",
                                       pci_bus_id="0:0"),),
                         hostname="node-1", backend="nvml", interval=0.5, meta={})

    def worst(alerting: bool) -> float:
        run = wandb.init(project="gpulens-bench", settings=lean)
        sink = WandbSink()
        sink.open(context)
        times = []
        for step in range(1, 7):
            events: tuple[Event, ...] = ()
            if alerting and step in (3, 5):
                events = (Event(kind="alert", name="input_bound",
                                state="firing" if step == 3 else "resolved", step=step,
                                time=time.time(), severity="warning",
                                message="data wait 41 % of the step", advice="more workers"),)
            row = Row(step=step, time=time.time(), values={
                "train/global_step": float(step), "gpu/0/power_w": 300.0,
                "alerts/input_bound": 1.0 if alerting and 3 <= step <= 4 else 0.0},
                events=events)
            times.append(_timed(lambda r=row: sink.write(r)))
        sink.close()
        run.finish()
        return max(times)

    with tempfile.TemporaryDirectory() as d:
        saved = dict(os.environ)
        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=d)
        try:
            return [Figure("W&B sink write() worst, rows with alerts (offline)", worst(True),
                           worst(False), 0.5)]
        finally:
            os.environ.clear()
            os.environ.update(saved)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short round (a smoke run: "
                        "each scenario once or a few times, the MLflow server started while "
                        "the others run)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    steps = 10 if args.quick else 40
    lag_steps = 1 if args.quick else max(3, steps // 8)
    mlflow = mlflow_installed()
    root = tempfile.TemporaryDirectory() if args.quick and mlflow else None
    early = start_server_early(Path(root.name)) if root is not None else None
    scenarios: list[Callable[[], list[Figure]]] = [
        lambda: engine_killed(steps), lambda: mlflow_down(steps, early), fork_exit,
        latest_on_death, lambda: verl_two_calls(steps // 2), record_tail,
        lambda: wandb_alerts(args.quick), lambda: row_lag(lag_steps), dashboard_page]
    if not mlflow:
        del scenarios[1]
    elif early is not None:  # last: its server has started meanwhile
        scenarios.append(scenarios.pop(1))
    figures: dict[str, list[Figure]] = {}
    try:
        for _ in range(rounds):
            for scenario in scenarios:
                for fig in scenario():
                    figures.setdefault(fig.name, []).append(fig)
    finally:
        if early is not None and root is not None:
            early.result().kill()
            root.cleanup()
    print(f"unit_timings: {rounds} round(s), {os.cpu_count()} cores, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| figure | worst of rounds | reference (median of rounds) | ratio | bound | check |")
    print("|---|---|---|---|---|---|")
    failed = 0
    for name, figs in figures.items():
        value = max(f.value_s for f in figs)
        reference = statistics.median(f.reference_s for f in figs)
        ok = all(f.ok for f in figs)
        failed += not ok
        ratio = value / reference if reference > 0 else float("inf")
        print(f"| {name} | {value * 1e3:.1f} ms | {reference * 1e3:.1f} ms | {ratio:.2f} | "
              f"{figs[0].bound_s * 1e3:.0f} ms | {'ok' if ok else 'FAILED'} |")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "unit_timings.json").write_text(json.dumps(
            {name: [f.as_dict() for f in figs] for name, figs in figures.items()}, indent=1))
    print(f"{failed} check(s) failed" if failed else "every check held")
    if args.quick:  # one short round proves the scenarios run; it is no measurement
        return 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
