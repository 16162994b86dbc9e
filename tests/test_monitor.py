"""Monitor end to end on simulated GPUs: rows, keys, energy, faults and bad input.

Every behaviour test runs on the default path (the engine in a process of its own) and on the
fallback (the engine in a thread): the ``isolation`` fixture.  The simulators pickle (loads
from :mod:`gpulens.testing`), so they cross into the engine process like real GPUs'
NVML would be opened there.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from pathlib import Path

import pytest

import gpulens
from gpulens.log import reset_warnings
from gpulens.schema import GPU_ROW_KEYS
from gpulens.testing import Constant, MemorySink, SimulatedNVML, Square, Steps
from tests.support.jsonl import read_rows
from tests.support.wait import wait_until


@pytest.fixture(params=["process", "thread"])
def isolation(request: pytest.FixtureRequest) -> str:
    reset_warnings()
    return str(request.param)


def _wait_until(sim: SimulatedNVML, t: float) -> None:
    """Sleep until ``t`` seconds after the simulator's epoch."""
    while sim.elapsed() < t:
        time.sleep(0.002)


def _phase_start(sim: SimulatedNVML, period: float) -> float:
    """The next start of a ``period`` after now, on the simulator's clock (loads are laid out
    from its epoch, and starting a monitor takes a moment)."""
    return (int(sim.elapsed() / period) + 1) * period


def _run(mon: gpulens.Monitor, steps: int, dt: float, **scalars: float) -> None:
    for step in range(1, steps + 1):
        time.sleep(dt)
        mon.log(step, loss=1.0 / step, **scalars)


def test_one_row_per_log_with_schema_keys(isolation: str) -> None:
    sink = MemorySink()
    sim = SimulatedNVML(gpus=2)
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=sim, isolation=isolation) as mon:
        assert mon.isolation == isolation
        _run(mon, 6, 0.1, learning_rate=1e-3, grad_norm=2.0)
    assert [r.step for r in sink.rows] == [1, 2, 3, 4, 5, 6]
    row = sink.rows[-1].values
    assert row["train/loss"] == pytest.approx(1 / 6)
    assert row["train/learning_rate"] == 1e-3 and row["train/grad_norm"] == 2.0
    assert row["train/global_step"] == 6.0
    for gpu in (0, 1):
        for key in ("util_pct", "sm_active_pct", "tensor_active_pct", "dram_bw_pct",
                    "mem_used_gb", "mem_pct", "power_w", "power_w_max", "energy_j",
                    "energy_err_j", "temp_c", "sm_clock_mhz", "throttle_pct", "samples"):
            assert f"gpu/{gpu}/{key}" in row, key
    assert {k.split("/")[2] for k in row if k.startswith("gpu/0/")} <= set(GPU_ROW_KEYS)
    assert "gpu/all/power_w_mean" in row and "host/ram_used_gb" in row
    assert row["perf/step_time_s"] == pytest.approx(0.1, abs=0.05)
    assert row["perf/partial_gpus"] == 0.0
    # not available is absent: no torch allocator in this process's CUDA
    assert "gpu/0/torch_allocated_gb" not in row
    assert sink.closed and sink.context is not None and len(sink.context.gpus) == 2
    # the energy counter's update period, probed while sampling began, told in a notice
    notes = [e for r in sink.rows for e in r.events if e.name == "energy_counter"]
    assert {tuple(e.data) for e in notes} == {("gpu/0/energy_update_s",),
                                              ("gpu/1/energy_update_s",)}
    assert all(e.data[k] == pytest.approx(0.1, abs=0.04) for e in notes for k in e.data)


def test_rows_come_soon_after_log(isolation: str) -> None:
    """Each row is finished while the run goes on, one after each log() (the driver's buffers
    are read early for it). How soon (about a quarter of a second, not at the next
    once-a-second read) is measured in benchmarks/unit_timings.py."""
    sink = MemorySink()
    with gpulens.Monitor(interval=0.5, sinks=[sink], backend=SimulatedNVML(gpus=1),
                         isolation=isolation) as mon:
        for step in range(1, 6):
            time.sleep(0.35)
            mon.log(step)
            wait_until(lambda s=step: len(sink.rows) == s, what=f"row {step}")
    assert [r.step for r in sink.rows] == [1, 2, 3, 4, 5]


def test_start_does_not_wait_for_the_first_sample(isolation: str, tmp_path: Path) -> None:
    """The engine's first reading is taken by its sampler thread, not on the way to start()
    returning (on two H200s it was 0.10-0.18 s of rank 0's start:
    benchmarks/results/2026-11-28-h200x2-start-laps). The GPU's reads here wait for a file:
    start() returns while they wait, and the rows then hold the GPU's figures."""
    from tests.support.marked_nvml import GatedNVML

    gate = tmp_path / "gate"
    sink = MemorySink()
    mon = gpulens.Monitor(interval=0.05, sinks=[sink], isolation=isolation,
                          backend=GatedNVML(str(gate), most_s=60.0, gpus=1))
    starting = threading.Thread(target=mon.start, daemon=True)
    starting.start()
    starting.join(30.0)
    try:
        assert not starting.is_alive(), "start() waited for the first sample"
        assert not sink.rows
    finally:
        gate.touch()
    for step in range(1, 4):
        time.sleep(0.1)
        mon.log(step)
    mon.stop()
    assert [r.step for r in sink.rows] == [1, 2, 3]
    assert all("gpu/0/util_pct" in r.values for r in sink.rows)


def test_latest_is_empty_until_the_first_reading_is_whole(tmp_path: Path) -> None:
    """The first reading is the sampler thread's, after start() returned: ``latest()`` holds
    nothing until it is whole (here it waits half way, on the second GPU), never the first
    GPU's figures without the second's and the host's."""
    from gpulens.engine.engine import Engine
    from gpulens.engine.spec import EngineSpec
    from tests.support.marked_nvml import LastGpuGated

    gate = tmp_path / "gate"
    sim = LastGpuGated(str(gate), most_s=60.0, gpus=2)
    engine = Engine(EngineSpec(interval=0.05, backend=sim, energy=False))
    engine.start()
    try:
        assert sim.held.wait(30.0)  # the thread has read GPU 0 and waits at GPU 1
        assert engine.latest() == {}
    finally:
        gate.touch()
    latest = wait_until(engine.latest, what="a first reading")
    assert "gpu/0/power_w" in latest and "gpu/1/power_w" in latest
    assert "host/ram_used_gb" in latest
    engine.stop(timeout=10.0)


def test_the_first_gpm_sample_comes_before_the_first_window_and_the_rest_after(
    tmp_path: Path,
) -> None:
    """GPM sees nothing before its first sample, so that one sample (cheap) is taken before
    the first window starts; the rest of the first reading (the cheap reads, the driver's
    buffers) is the sampler thread's, after the start."""
    from gpulens.engine.engine import Engine
    from gpulens.engine.spec import EngineSpec
    from tests.support.marked_nvml import GatedNVML

    gate = tmp_path / "gate"
    sim = GatedNVML(str(gate), most_s=60.0, gpus=1)
    engine = Engine(EngineSpec(interval=0.05, backend=sim, energy=False))
    engine.start()
    sampler = engine._sampler
    assert sampler is not None
    try:
        assert sim.gpm_sampled and sim.gpm_sampled[0] <= sampler._window_start
        assert not sampler.first_read.is_set()
    finally:
        gate.touch()
    assert sampler.first_read.wait(30.0)
    engine.stop(5.0)


def test_a_start_says_where_its_time_went_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    """At DEBUG a start says its laps once each: the monitor's, the engine process's and the
    engine's own (benchmarks/start_ddp.py --laps keeps them); nothing at INFO."""
    with caplog.at_level(logging.INFO, logger="gpulens"):
        gpulens.Monitor(interval=0.05, backend=SimulatedNVML(gpus=1)).start().stop()
    assert not [r for r in caplog.records if " (s): " in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="gpulens"):
        gpulens.Monitor(interval=0.05, backend=SimulatedNVML(gpus=1)).start().stop()
    laps = sorted(r.getMessage().split(" (s): ")[0] for r in caplog.records
                  if " (s): " in r.getMessage())
    assert laps == ["gpulens: engine process start", "gpulens: engine start", "gpulens: start"]
    engine = next(r.getMessage() for r in caplog.records
                  if r.getMessage().startswith("gpulens: engine start (s): "))
    assert [part.split(" ")[0] for part in engine.split(" (s): ")[1].split(", ")] == [
        "nvml", "gpus", "context", "sampler", "total"]


def test_energy_follows_the_load_and_adds_up(isolation: str) -> None:
    """Per-step energy against the simulator's exact integral (power samples are 20 ms
    averages there, the counter updates every 100 ms at its own phase and each read takes
    3-15 ms): close per step, inside its stated bound, and the run's sum within 2.5 % (the
    counter's span is only 4 s here: each read's staleness is still a few percent of it)."""
    sink = MemorySink()
    sim = SimulatedNVML(gpus=1, load=Square(period=0.6), seed=3)
    marks: list[float] = []
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=sim, isolation=isolation) as mon:
        for step in range(1, 41):
            time.sleep(0.1)
            marks.append(sim.elapsed())
            mon.log(step)
    errors, total, exact_total, inside = [], 0.0, 0.0, 0
    for i in range(1, len(marks)):
        row = sink.rows[i].values
        exact = sim.energy_j(0, marks[i]) - sim.energy_j(0, marks[i - 1])
        errors.append(abs(row["gpu/0/energy_j"] - exact) / exact)
        inside += abs(row["gpu/0/energy_j"] - exact) <= row["gpu/0/energy_err_j"]
        total += row["gpu/0/energy_j"]
        exact_total += exact
    assert statistics.median(errors) < 0.03, errors
    assert inside >= 0.95 * len(errors)
    assert total == pytest.approx(exact_total, rel=0.025)


def test_busy_and_idle_steps_show_as_such(isolation: str) -> None:
    """300 ms busy / 300 ms idle steps, logged at the phase edges (the fidelity benchmark's
    pattern): GPM's refresh timing (100 ms, ~90 ms late) is undone, utilization and power too."""
    sink = MemorySink()
    sim = SimulatedNVML(gpus=1, load=Square(period=0.6), seed=1)
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=sim, isolation=isolation) as mon:
        base = _phase_start(sim, 0.6)  # an idle phase starts there
        for step in range(0, 9):
            _wait_until(sim, base + step * 0.3)
            mon.log(step)
    rows = [r.values for r in sink.rows][1:]
    busy = [r for r in rows if int(r["train/global_step"]) % 2 == 0]
    idle = [r for r in rows if int(r["train/global_step"]) % 2 == 1]
    # utilization comes in 200 ms samples: coarser than the 300 ms phases
    for key, hi, lo in (("sm_active_pct", 75, 25), ("util_pct", 60, 45), ("power_w", 500, 250)):
        b = sum(r[f"gpu/0/{key}"] for r in busy) / len(busy)
        i = sum(r[f"gpu/0/{key}"] for r in idle) / len(idle)
        assert b >= hi and i <= lo, (key, b, i)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_gpm_placement_holds_over_a_range_of_delays_and_phases(seed: int) -> None:
    """The simulator draws GPM's delay (60-120 ms) and refresh phase at random: the code's
    fixed 90 ms shift must still tell busy from idle steps."""
    sink = MemorySink()
    sim = SimulatedNVML(gpus=1, load=Square(period=0.6), seed=seed)
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=sim) as mon:
        base = _phase_start(sim, 0.6)
        for step in range(0, 9):
            _wait_until(sim, base + step * 0.3)
            mon.log(step)
    rows = [r.values for r in sink.rows][1:]
    busy = [r["gpu/0/sm_active_pct"] for r in rows if int(r["train/global_step"]) % 2 == 0]
    idle = [r["gpu/0/sm_active_pct"] for r in rows if int(r["train/global_step"]) % 2 == 1]
    assert min(busy) > 60 and max(idle) < 40, (sim.gpm_delay_s, busy, idle)


def test_log_every_n_steps_divides_per_step_figures(isolation: str) -> None:
    """A row every 10 steps: per-step figures are the window's over 10. The windows' bounds
    are read around the calls (a loaded host delays start()'s return, not the window)."""
    sink = MemorySink()
    t0 = time.monotonic()
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=SimulatedNVML(gpus=1),
                         isolation=isolation) as mon:
        time.sleep(0.2)
        t1 = time.monotonic()
        mon.log(10)
        t2 = time.monotonic()
        time.sleep(0.2)
        t3 = time.monotonic()
        mon.log(20)
        t4 = time.monotonic()
    first, last = sink.rows[0].values, sink.rows[-1].values
    assert first["perf/steps"] == 10.0  # the first window covers steps 1..10 too
    # it starts inside start(), before the sleep, and ends at log(10)
    assert 0.2 / 10 - 1e-3 <= first["perf/step_time_s"] <= (t2 - t0) / 10 + 1e-3
    assert last["perf/steps"] == 10.0
    assert (t3 - t2) / 10 - 1e-3 <= last["perf/step_time_s"] <= (t4 - t1) / 10 + 1e-3
    assert last["perf/energy_per_step_j"] == pytest.approx(last["gpu/0/energy_j"] / 10)


def test_resumed_run_starts_at_its_step(isolation: str) -> None:
    sink = MemorySink()
    mon = gpulens.Monitor(interval=0.05, sinks=[sink], backend=SimulatedNVML(gpus=1),
                          isolation=isolation)
    mon.start(step=5000)
    time.sleep(0.1)
    mon.log(5004)
    mon.stop()
    assert sink.rows[0].values["perf/steps"] == 4.0


def test_jsonl_lines_are_flushed_as_they_are_written(tmp_path: Path, isolation: str) -> None:
    path = tmp_path / "deep" / "gpu.jsonl"
    mon = gpulens.Monitor(interval=0.05, sinks=[f"jsonl:{path}"], backend=SimulatedNVML(gpus=1),
                          isolation=isolation)
    mon.start()
    try:
        for step in (1, 2, 3):
            time.sleep(0.05)
            mon.log(step, loss=float("nan") if step == 3 else 0.5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(read_rows(path)) < 2:
            time.sleep(0.05)
        # readable while the job still runs (a killed job leaves these lines)
        lines = read_rows(path)
        assert lines and lines[0]["step"] == 1 and "gpu/0/power_w" in lines[0]
        assert abs(lines[0]["time"] - time.time()) < 10
    finally:
        mon.stop()
    rows = read_rows(path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["train/loss"] is None


def test_stop_is_idempotent_and_start_again_works(isolation: str) -> None:
    sink = MemorySink()
    mon = gpulens.Monitor(interval=0.05, sinks=[sink], backend=SimulatedNVML(gpus=1),
                          isolation=isolation)
    mon.start()
    mon.log(1)
    mon.stop()
    mon.stop()
    with pytest.raises(RuntimeError, match=r"log\(\) after stop\(\)"):
        mon.log(2)
    mon.start()
    mon.log(2)
    mon.stop()
    assert [r.step for r in sink.rows] == [1, 2]
    assert not any(t.name.startswith("gpulens-sampler") for t in threading.enumerate())


def test_training_thread_sinks_are_written_from_the_training_thread(isolation: str) -> None:
    sink = MemorySink(on_training_thread=True)
    per_log: list[int] = []
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=SimulatedNVML(gpus=1),
                         isolation=isolation) as mon:
        for step in range(1, 41):
            time.sleep(0.05)
            before = len(sink.rows)
            mon.log(step)
            per_log.append(len(sink.rows) - before)
    assert [r.step for r in sink.rows] == list(range(1, 41))
    assert sink.write_threads == {threading.current_thread().name}
    # no single log() writes a burst
    assert max(per_log) <= 2 and sum(per_log) >= 15


def test_latest_has_every_live_figure(isolation: str) -> None:
    """The live view's figures, also those the buffered samples give instead of cheap reads."""
    sim = SimulatedNVML(gpus=2, load=Steps(((0.3, 1.0),)))
    with gpulens.Monitor(interval=0.05, backend=sim, isolation=isolation) as mon:
        time.sleep(1.6)  # past the first slow read: power and utilization come buffered now
        latest = mon.latest()
    # fresh figures, not the first read's (idle) held on
    assert latest["gpu/0/power_w"] > 600 and latest["gpu/1/util_pct"] > 90
    for gpu in (0, 1):
        for key in ("util_pct", "power_w", "power_limit_w", "mem_used_gb", "temp_c",
                    "sm_clock_mhz", "sm_active_pct"):
            assert f"gpu/{gpu}/{key}" in latest, key
    assert "host/ram_used_gb" in latest
    assert mon.latest() == {}  # stopped


def test_env_selects_simulated_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with gpulens.Monitor(interval=0.1) as mon:
        assert mon.context is not None and mon.isolation == "process"
        assert mon.context.backend == "simulated" and len(mon.context.gpus) == 3


def test_cuda_visible_devices_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5105a7ed-0000-4000-8000-000000000002")
    sim = SimulatedNVML(gpus=3)
    with gpulens.Monitor(interval=0.1, backend=sim) as mon:
        assert mon.context is not None
        (gpu,) = mon.context.gpus
        assert gpu.index == 0 and gpu.uuid.endswith("000000000002")


def test_mig_instance_maps_to_its_parent_gpu(
    monkeypatch: pytest.MonkeyPatch, isolation: str,
) -> None:
    sim = SimulatedNVML(gpus=2, mig={1: ["3g.40gb", "3g.40gb"]})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", sim.mig_uuid(1, 1))
    sink = MemorySink()
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=sim, isolation=isolation) as mon:
        _run(mon, 2, 0.1)
    assert mon.context is not None
    (gpu,) = mon.context.gpus
    assert gpu.uuid == sim.gpu_uuid(1)  # the parent's metrics
    assert gpu.mig is not None and "3g.40gb" in gpu.mig and sim.mig_uuid(1, 1) in gpu.mig
    assert "gpu/0/power_w" in sink.rows[-1].values


def test_mig_instance_that_matches_nothing_is_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, isolation: str,
) -> None:
    sim = SimulatedNVML(gpus=1, mig={0: ["7g.80gb"]})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-ffffffff-0000-0000-0000-000000000000")
    with caplog.at_level(logging.WARNING, logger="gpulens"), gpulens.Monitor(
            interval=0.05, backend=sim, isolation=isolation) as mon:
        assert mon.context is not None and mon.context.gpus == ()
    assert "matches no GPU that NVML sees" in caplog.text
    assert sim.mig_uuid(0, 0) in caplog.text  # says what there is


# -- bad input: ValueError before any training --------------------------------------------------
@pytest.mark.parametrize("interval", [0, -1, float("nan"), "fast", True])
def test_bad_interval(interval: object) -> None:
    with pytest.raises(ValueError, match="interval"):
        gpulens.Monitor(interval=interval)  # type: ignore[arg-type]


def test_unknown_sink() -> None:
    with pytest.raises(ValueError, match=r"unknown sink 'tensorboard'.*known sinks"):
        gpulens.Monitor(sinks=["tensorboard"])


def test_unwritable_jsonl_path(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot write the JSONL record"):
        gpulens.Monitor(sinks=[f"jsonl:{blocker / 'gpu.jsonl'}"])  # a file where a folder must be
    if os.geteuid() != 0:  # root may write into a read-only folder
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(ValueError, match="cannot write the JSONL record"):
                gpulens.Monitor(sinks=[f"jsonl:{ro / 'gpu.jsonl'}"])
        finally:
            ro.chmod(0o700)
    with pytest.raises(ValueError, match="needs a path"):
        gpulens.Monitor(sinks=["jsonl"])
    with pytest.raises(ValueError, match="is a directory"):
        gpulens.Monitor(sinks=[f"jsonl:{tmp_path}"])


def test_gpu_that_does_not_exist(isolation: str) -> None:
    mon = gpulens.Monitor(gpus=[5], backend=SimulatedNVML(gpus=2), isolation=isolation)
    with pytest.raises(ValueError, match=r"GPU 5 does not exist: this process sees 2 GPU"):
        mon.start()
    assert not mon.running
    with pytest.raises(ValueError, match="gpus"):
        gpulens.Monitor(gpus=[-1])


def test_bad_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="backend 'cuda'"):
        gpulens.Monitor(backend="cuda")
    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "two")
    with pytest.raises(ValueError, match="GPULENS_SIMULATED_GPUS"):
        gpulens.Monitor().start()


def test_log_before_start_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="before start"):
        gpulens.Monitor().log(1)


def test_steps_going_backwards_and_values_that_are_no_numbers_are_told(
    caplog: pytest.LogCaptureFixture, isolation: str,
) -> None:
    sink = MemorySink()
    with caplog.at_level(logging.WARNING, logger="gpulens"), gpulens.Monitor(
            interval=0.05, sinks=[sink], backend=SimulatedNVML(gpus=1),
            isolation=isolation) as mon:
        mon.log(5, loss=1.0)
        time.sleep(0.05)
        mon.log(3, loss="high")  # type: ignore[arg-type]
    assert "steps went backwards" in caplog.text
    assert "logged value 'loss' (str) could not be read as a number" in caplog.text
    assert [r.step for r in sink.rows] == [5, 3]
    assert "train/loss" not in sink.rows[1].values


# -- faults: training goes on, and the user hears of it ------------------------------------------
def test_no_driver_warns_once_and_logs_host_and_training(
    caplog: pytest.LogCaptureFixture, isolation: str,
) -> None:
    sink = MemorySink()
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        for _ in range(2):
            with gpulens.Monitor(interval=0.05, sinks=[sink], isolation=isolation,
                                 backend=SimulatedNVML(driver_loaded=False)) as mon:
                _run(mon, 2, 0.05)
    warnings = [r for r in caplog.records if "NVML could not be initialised" in r.message]
    # once per process: the engine process is new each run, the thread engine is not
    assert len(warnings) == (2 if isolation == "process" else 1)
    assert all(r.levelno == logging.WARNING and r.name == "gpulens" for r in warnings)
    assert len(sink.rows) == 4
    row = sink.rows[-1].values
    assert not any(k.startswith("gpu/") for k in row)
    assert "host/ram_used_gb" in row and row["train/loss"] == 0.5


def test_no_driver_with_nvml_asked_for_is_an_error() -> None:
    # on this machine there is no NVIDIA driver
    mon = gpulens.Monitor(backend="nvml")
    try:
        mon.start()
    except ValueError as exc:
        assert "backend='nvml'" in str(exc)
    else:  # pragma: no cover - only on a machine with a GPU
        mon.stop()


def test_not_supported_on_one_gpu_is_absent_for_that_gpu_only(
    caplog: pytest.LogCaptureFixture, isolation: str,
) -> None:
    sink = MemorySink()
    sim = SimulatedNVML(gpus=2, not_supported={1: {"nvmlDeviceGetPowerUsage",
                                                   "nvmlDeviceGetSamples",
                                                   "nvmlDeviceGetTotalEnergyConsumption"}})
    with caplog.at_level(logging.INFO, logger="gpulens"), gpulens.Monitor(
            interval=0.05, sinks=[sink], backend=sim, isolation=isolation) as mon:
        _run(mon, 3, 0.1)
    row = sink.rows[-1].values
    assert "gpu/0/power_w" in row and "gpu/0/energy_j" in row
    assert "gpu/1/power_w" not in row and "gpu/1/energy_j" not in row
    assert "gpu/1/power_w_max" not in row
    assert "gpu/1/util_pct" in row and "gpu/1/temp_c" in row  # the rest goes on
    told = [r for r in caplog.records if "GPU 1: power not available" in r.message]
    assert len(told) == 1 and told[0].levelno == logging.INFO


def test_a_metric_that_stops_reading_is_absent_not_stale(
    caplog: pytest.LogCaptureFixture, isolation: str,
) -> None:
    """Temperature fails from 5 s on: later rows leave it out (never the last value held),
    the rest of the row goes on, and the user hears why. (5 s: a start on a loaded machine
    can take seconds, and the monitor must be running before the sensor fails.)"""
    sink = MemorySink()
    sim = SimulatedNVML(gpus=1, load=Constant(0.9),
                        fail_after={0: {"nvmlDeviceGetTemperature": 5.0}})
    with caplog.at_level(logging.WARNING, logger="gpulens"), gpulens.Monitor(
            interval=0.05, sinks=[sink], backend=sim, isolation=isolation) as mon:
        assert sim.elapsed() < 4.8  # the monitor started before the sensor fails
        _wait_until(sim, 4.9)
        mon.log(1)
        _wait_until(sim, 7.0)
        mon.log(2)
        time.sleep(0.3)
        mon.log(3)
    first, later, last = (r.values for r in sink.rows)
    assert first["gpu/0/temp_c"] == pytest.approx(32 + 45 * 0.9, abs=1)
    assert "gpu/0/temp_c" not in last and "gpu/0/temp_c_max" not in last
    assert "gpu/0/power_w" in last and "gpu/0/mem_used_gb" in last
    assert last["perf/partial_gpus"] == 1.0
    assert "NVML temperature failed on GPU 0" in caplog.text
    assert "lacks temp_c" in caplog.text
    del later


def test_gpu_lost_mid_run(caplog: pytest.LogCaptureFixture, isolation: str) -> None:
    sink = MemorySink()
    sim = SimulatedNVML(gpus=2, lose_gpu_after={1: 5.0})  # 5 s: after a slow start, too
    with caplog.at_level(logging.WARNING, logger="gpulens"), gpulens.Monitor(
        interval=0.05, sinks=[sink], backend=sim, isolation=isolation,
    ) as mon:
        assert sim.elapsed() < 4.8
        _wait_until(sim, 4.9)
        mon.log(1)
        _wait_until(sim, 6.0)
        for step in range(2, 13):
            time.sleep(0.1)
            mon.log(step)
    assert any("fell off the bus" in r.message for r in caplog.records)
    assert len(sink.rows) == 12
    first, last = sink.rows[0].values, sink.rows[-1].values
    assert "gpu/1/power_w" in first
    assert not any(k.startswith("gpu/1/") for k in last)
    assert "gpu/0/power_w" in last
    assert last["perf/partial_gpus"] == 0.0  # a lost GPU is told, not a partial window


def test_gpu_lost_mid_run_is_a_notice_in_the_record(tmp_path: Path, isolation: str) -> None:
    """The loss is told in the record too (a notice event), not only on stderr: the JSONL and
    the report then say why GPU 1's figures stop."""
    path = tmp_path / "run.jsonl"
    sim = SimulatedNVML(gpus=2, lose_gpu_after={1: 1.0})
    with gpulens.Monitor(interval=0.05, sinks=[f"jsonl:{path}"], backend=sim,
                         isolation=isolation) as mon:
        for step in range(1, 30):
            time.sleep(0.1)
            mon.log(step)
            if sim.elapsed() > 2.0 and step > 3:
                break
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lost = [e for e in lines if e.get("event") == "notice" and e.get("name") == "gpu_lost"]
    assert len(lost) == 1, lines
    assert "GPU 1" in lost[0]["message"] and lost[0]["severity"] == "warning"


def crashing_load(gpu: int, t: float) -> float:
    if t > 2.0:
        raise RuntimeError("simulated driver crash")
    return 0.5


def test_sampler_failure_warns_and_training_goes_on(
    caplog: pytest.LogCaptureFixture, isolation: str,
) -> None:
    sink = MemorySink()
    sim = SimulatedNVML(gpus=1, load=crashing_load)
    with caplog.at_level(logging.WARNING, logger="gpulens"), gpulens.Monitor(
        interval=0.05, sinks=[sink], backend=sim, isolation=isolation,
    ) as mon:
        _wait_until(sim, 2.1)
        _run(mon, 8, 0.1)
    assert any("sampler failed" in r.message for r in caplog.records)
    assert [r.step for r in sink.rows] == list(range(1, 9))


def test_a_fault_at_the_first_sample_is_said_and_training_goes_on(
    caplog: pytest.LogCaptureFixture, isolation: str,
) -> None:
    """The first sample is the sampler thread's (it used to fail the start): its fault is a
    WARNING heard here, from the engine process too, and the rows come, GPU figures in them."""
    from tests.support.marked_nvml import FirstReadFails

    sink = MemorySink()
    with caplog.at_level(logging.WARNING, logger="gpulens"), gpulens.Monitor(
        interval=0.05, sinks=[sink], backend=FirstReadFails(gpus=1), isolation=isolation,
    ) as mon:
        _run(mon, 4, 0.1)
    assert any("sampler failed" in r.message and "simulated fault at the first sample"
               in r.message for r in caplog.records)
    assert [r.step for r in sink.rows] == [1, 2, 3, 4]
    assert "gpu/0/power_w" in sink.rows[-1].values


def test_failing_sink_is_retried_then_counted(
    caplog: pytest.LogCaptureFixture, isolation: str,
) -> None:
    flaky, good = MemorySink(), MemorySink()
    flaky.fail = True
    mon = gpulens.Monitor(interval=0.05, sinks=[flaky, good], backend=SimulatedNVML(gpus=1),
                          buffer_rows=4, isolation=isolation)
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        mon.start()
        for step in range(1, 7):
            mon.log(step)
            # each row is finished (and the flaky sink has tried it) before the next log
            wait_until(lambda s=step: len(good.rows) == s, what=f"row {step} written")
        flaky.fail = False  # the tracker comes back: the buffered rows are delivered
        wait_until(lambda: len(flaky.rows) == 4, what="the 4 buffered rows delivered late")
        stats = mon.stop(timeout=2)
    assert [r.step for r in good.rows] == [1, 2, 3, 4, 5, 6]
    st = stats["MemorySink"]
    assert st.failures >= 1
    # the buffer held 4 rows: the two oldest were dropped and counted, the rest delivered late
    assert [r.step for r in flaky.rows] == [3, 4, 5, 6]
    assert (st.written, st.dropped) == (4, 2)
    assert stats["MemorySink#2"].dropped == 0
    assert any("failed to write" in r.message for r in caplog.records)
    assert any("MemorySink: 4 rows written, 2 dropped" in r.message for r in caplog.records)


def test_stop_waits_while_a_slow_sink_makes_progress_and_says_so(
    caplog: pytest.LogCaptureFixture, isolation: str,
) -> None:
    """A sink that writes slowly (a far tracker) is waited for, and stop() tells what for."""
    slow = SlowSink(delay=0.35)
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        mon = gpulens.Monitor(interval=0.05, sinks=[slow], backend=SimulatedNVML(gpus=1),
                              isolation=isolation).start()
        for step in range(1, 13):
            time.sleep(0.02)
            mon.log(step)
        stats = mon.stop(timeout=30)
    assert [r.step for r in slow.rows] == list(range(1, 13))
    assert stats["SlowSink"].written == 12 and stats["SlowSink"].dropped == 0
    assert "stop() is waiting for SlowSink" in caplog.text


class SlowSink(MemorySink):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def write(self, row: gpulens.Row) -> None:
        time.sleep(self.delay)
        super().write(row)


def test_memory_is_bounded_over_many_rows() -> None:
    """20,000 steps at 5 kHz: the engine's series stay bounded (the thread engine, whose
    sampler is reachable from here)."""
    mon = gpulens.Monitor(interval=0.01, sinks=[], backend=SimulatedNVML(gpus=1),
                          isolation="thread")
    mon.start()
    try:
        for step in range(1, 20_001):
            mon.log(step)
            if step % 2000 == 0:
                time.sleep(0.05)
        time.sleep(1.5)
        engine = mon._transport._engine  # type: ignore[union-attr]
        sampler = engine._sampler
        assert sampler is not None
        gpu = sampler.gpus[0]
        assert len(sampler.marks) < 20_000
        assert len(gpu.fast) < 5_000 and len(gpu.power_fast) < 5_000
        assert len(gpu.power_buf) < 5_000
    finally:
        mon.stop()
