"""Monitor end to end on simulated GPUs: rows, keys, energy, faults and bad input."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

import gpulens
from gpulens.schema import GPU_ROW_KEYS
from gpulens.testing import MemorySink, SimulatedNVML


def _run(mon: gpulens.Monitor, steps: int, dt: float, **scalars: float) -> None:
    for step in range(1, steps + 1):
        time.sleep(dt)
        mon.log(step, loss=1.0 / step, **scalars)


def test_one_row_per_log_with_schema_keys(tmp_path: Path) -> None:
    sink = MemorySink()
    sim = SimulatedNVML(gpus=2)
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=sim) as mon:
        _run(mon, 6, 0.1, learning_rate=1e-3, grad_norm=2.0)
    assert [r.step for r in sink.rows] == [1, 2, 3, 4, 5, 6]
    row = sink.rows[-1].values
    assert row["train/loss"] == pytest.approx(1 / 6)
    assert row["train/learning_rate"] == 1e-3 and row["train/grad_norm"] == 2.0
    assert row["train/global_step"] == 6.0
    for gpu in (0, 1):
        for key in ("util_pct", "sm_active_pct", "tensor_active_pct", "dram_bw_pct",
                    "mem_used_gb", "mem_pct", "power_w", "power_w_max", "energy_j", "temp_c",
                    "sm_clock_mhz", "throttle_pct", "samples"):
            assert f"gpu/{gpu}/{key}" in row, key
    assert {k.split("/")[2] for k in row if k.startswith("gpu/0/")} <= set(GPU_ROW_KEYS)
    assert "gpu/all/power_w_mean" in row and "host/ram_used_gb" in row
    assert row["perf/step_time_s"] == pytest.approx(0.1, abs=0.05)
    # not available is absent: no torch allocator in this process's CUDA
    assert "gpu/0/torch_allocated_gb" not in row
    assert sink.closed and sink.context is not None and len(sink.context.gpus) == 2


def test_figures_follow_the_simulated_load() -> None:
    """Busy and idle seconds show up as such, energy matches the simulator's integral."""
    def load(gpu: int, t: float) -> float:
        return 1.0 if int(t / 0.5) % 2 == 0 else 0.0

    sink = MemorySink()
    sim = SimulatedNVML(gpus=1, load=load)
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=sim) as mon:
        t0 = sim.clock() - (sim._t0 or 0)
        for step in range(1, 9):
            # log at the middle of each busy/idle half second
            target = (step + 0.5) * 0.5
            while sim.clock() - (sim._t0 or 0) < target:
                time.sleep(0.005)
            mon.log(step)
        t_end = sim.clock() - (sim._t0 or 0)
    rows = [r.values for r in sink.rows]
    assert len(rows) == 8
    energy = sum(r["gpu/0/energy_j"] for r in rows)
    # energy over the monitored span equals the simulator's exact integral (to the edges)
    exact = sim.energy_j(0, t_end) - sim.energy_j(0, t0)
    assert energy == pytest.approx(exact, rel=0.08)
    assert max(r["gpu/0/sm_active_pct"] for r in rows) > 40
    for r in rows:
        assert r["gpu/0/mem_used_gb_max"] <= sim.MEM_TOTAL / 1e9
        assert r["gpu/0/power_w_max"] <= sim.MAX_W + 1e-6


def test_busy_and_idle_steps_show_as_such() -> None:
    """300 ms busy / 300 ms idle steps, logged at the phase edges (the fidelity benchmark's
    pattern): GPM's refresh timing (100 ms, 90 ms late) is undone, utilization and power too."""
    def load(gpu: int, t: float) -> float:
        return 1.0 if int(t / 0.3) % 2 == 1 else 0.0

    sink = MemorySink()
    sim = SimulatedNVML(gpus=1, load=load)
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=sim) as mon:
        for step in range(1, 9):
            while sim.clock() - (sim._t0 or 0) < step * 0.3:
                time.sleep(0.002)
            mon.log(step)
    rows = [r.values for r in sink.rows]
    busy = [r for r in rows if int(r["train/global_step"]) % 2 == 0]
    idle = [r for r in rows[1:] if int(r["train/global_step"]) % 2 == 1]
    for key, hi, lo in (("sm_active_pct", 80, 20), ("util_pct", 70, 30), ("power_w", 500, 250)):
        b = sum(r[f"gpu/0/{key}"] for r in busy) / len(busy)
        i = sum(r[f"gpu/0/{key}"] for r in idle) / len(idle)
        assert b >= hi and i <= lo, (key, b, i)


def test_log_every_n_steps_divides_per_step_figures() -> None:
    sink = MemorySink()
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=SimulatedNVML(gpus=1)) as mon:
        time.sleep(0.2)
        mon.log(10)
        time.sleep(0.2)
        mon.log(20)
    first, last = sink.rows[0].values, sink.rows[-1].values
    assert first["perf/steps"] == 10.0  # the first window covers steps 1..10 too
    assert first["perf/step_time_s"] == pytest.approx(0.02, abs=0.01)
    assert last["perf/steps"] == 10.0
    assert last["perf/step_time_s"] == pytest.approx(0.02, abs=0.01)
    assert last["perf/energy_per_step_j"] == pytest.approx(last["gpu/0/energy_j"] / 10)


def test_resumed_run_starts_at_its_step() -> None:
    sink = MemorySink()
    mon = gpulens.Monitor(interval=0.05, sinks=[sink], backend=SimulatedNVML(gpus=1))
    mon.start(step=5000)
    time.sleep(0.1)
    mon.log(5004)
    mon.stop()
    assert sink.rows[0].values["perf/steps"] == 4.0


def test_energy_counter_reads_too_close_together_are_not_kept() -> None:
    """NVML's counter ticks every ~100 ms: a read soon after another (the last pass at stop)
    would give the windows between them 0 J for energy that was used."""
    sink = MemorySink()
    sim = SimulatedNVML(gpus=1, load=lambda g, t: 0.9)
    mon = gpulens.Monitor(interval=0.05, sinks=[sink], backend=sim)
    mon.start()
    sampler = mon._sampler
    assert sampler is not None
    gpu = sampler.gpus[0]
    time.sleep(0.35)
    mon.stop()  # joins the sampler thread, so its series are ours to read
    n = len(gpu.energy_mj)
    sampler._read_slow(time.monotonic())
    sampler._read_slow(time.monotonic())
    assert len(gpu.energy_mj) == n
    time.sleep(0.35)
    sampler._read_slow(time.monotonic())
    assert len(gpu.energy_mj) == n + 1
    assert all(b - a >= 0.3 for a, b in zip(gpu.energy_mj.t, gpu.energy_mj.t[1:], strict=False))


def test_jsonl_lines_are_flushed_as_they_are_written(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "gpu.jsonl"
    mon = gpulens.Monitor(interval=0.05, sinks=[f"jsonl:{path}"], backend=SimulatedNVML(gpus=1))
    mon.start()
    try:
        for step in (1, 2, 3):
            time.sleep(0.05)
            mon.log(step, loss=float("nan") if step == 3 else 0.5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(path.read_text().splitlines()) < 2:
            time.sleep(0.05)
        # readable while the job still runs (a killed job leaves these lines)
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        assert lines and lines[0]["step"] == 1 and "gpu/0/power_w" in lines[0]
        assert abs(lines[0]["time"] - time.time()) < 10
    finally:
        mon.stop()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["train/loss"] is None


def test_stop_is_idempotent_and_start_again_works() -> None:
    sink = MemorySink()
    mon = gpulens.Monitor(interval=0.05, sinks=[sink], backend=SimulatedNVML(gpus=1))
    mon.start()
    mon.log(1)
    mon.stop()
    mon.stop()
    mon.start()
    mon.log(2)
    mon.stop()
    assert [r.step for r in sink.rows] == [1, 2]
    assert not any(t.name == "gpulens-sampler" for t in threading.enumerate())


def test_training_thread_sinks_are_written_from_the_training_thread() -> None:
    sink = MemorySink(on_training_thread=True)
    per_log: list[int] = []
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=SimulatedNVML(gpus=1)) as mon:
        for step in range(1, 41):
            time.sleep(0.05)
            before = len(sink.rows)
            mon.log(step)
            per_log.append(len(sink.rows) - before)
    assert [r.step for r in sink.rows] == list(range(1, 41))
    assert sink.write_threads == {threading.current_thread().name}
    # rows come finished in bursts (after each slow read): no single log() writes a burst
    assert max(per_log) <= 2 and sum(per_log) >= 15


def test_latest_has_every_live_figure() -> None:
    """The live view's figures, also those the buffered samples give instead of cheap reads."""
    sim = SimulatedNVML(gpus=2, load=lambda g, t: 0.0 if t < 0.3 else 1.0)
    with gpulens.Monitor(interval=0.05, backend=sim) as mon:
        time.sleep(1.6)  # past the first slow read: power and utilization come buffered now
        latest = mon.latest()
    # fresh figures, not the first read's (idle) held on
    assert latest["gpu/0/power_w"] > 600 and latest["gpu/1/util_pct"] > 90
    for gpu in (0, 1):
        for key in ("util_pct", "power_w", "power_limit_w", "mem_used_gb", "temp_c",
                    "sm_clock_mhz", "sm_active_pct"):
            assert f"gpu/{gpu}/{key}" in latest, key
    assert "host/ram_used_gb" in latest


def test_env_selects_simulated_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULENS_BACKEND", "simulated")
    monkeypatch.setenv("GPULENS_SIMULATED_GPUS", "3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with gpulens.Monitor(interval=0.1) as mon:
        assert mon.context is not None
        assert mon.context.backend == "simulated" and len(mon.context.gpus) == 3


def test_cuda_visible_devices_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5105a7ed-0000-4000-8000-000000000002")
    sim = SimulatedNVML(gpus=3)
    with gpulens.Monitor(interval=0.1, backend=sim) as mon:
        assert mon.context is not None
        (gpu,) = mon.context.gpus
        assert gpu.index == 0 and gpu.uuid.endswith("000000000002")


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


def test_gpu_that_does_not_exist() -> None:
    mon = gpulens.Monitor(gpus=[5], backend=SimulatedNVML(gpus=2))
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


# -- faults: training goes on ----------------------------------------------------------------------
def test_no_driver_warns_once_and_logs_host_and_training(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = MemorySink()
    from gpulens._warn import reset_warnings

    reset_warnings()
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        for _ in range(2):
            with gpulens.Monitor(interval=0.05, sinks=[sink],
                                 backend=SimulatedNVML(driver_loaded=False)) as mon:
                _run(mon, 2, 0.05)
    warnings = [r for r in caplog.records if "NVML could not be initialised" in r.message]
    assert len(warnings) == 1
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


def test_not_supported_on_one_gpu_is_absent_for_that_gpu_only() -> None:
    sink = MemorySink()
    sim = SimulatedNVML(gpus=2, not_supported={1: {"nvmlDeviceGetPowerUsage",
                                                   "nvmlDeviceGetSamples",
                                                   "nvmlDeviceGetTotalEnergyConsumption"}})
    with gpulens.Monitor(interval=0.05, sinks=[sink], backend=sim) as mon:
        _run(mon, 3, 0.1)
    row = sink.rows[-1].values
    assert "gpu/0/power_w" in row and "gpu/0/energy_j" in row
    assert "gpu/1/power_w" not in row and "gpu/1/energy_j" not in row
    assert "gpu/1/power_w_max" not in row
    assert "gpu/1/util_pct" in row and "gpu/1/temp_c" in row  # the rest goes on


def test_gpu_lost_mid_run(caplog: pytest.LogCaptureFixture) -> None:
    sink = MemorySink()
    sim = SimulatedNVML(gpus=2, lose_gpu_after={1: 0.4})
    with caplog.at_level(logging.WARNING, logger="gpulens"), gpulens.Monitor(
        interval=0.05, sinks=[sink], backend=sim
    ) as mon:
        _run(mon, 12, 0.1)
    assert any("fell off the bus" in r.message for r in caplog.records)
    assert len(sink.rows) == 12
    first, last = sink.rows[0].values, sink.rows[-1].values
    assert "gpu/1/power_w" in first
    assert not any(k.startswith("gpu/1/") for k in last)
    assert "gpu/0/power_w" in last


def test_sampler_failure_warns_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    def load(gpu: int, t: float) -> float:
        if t > 0.3:
            raise RuntimeError("simulated driver crash")
        return 0.5

    sink = MemorySink()
    with caplog.at_level(logging.WARNING, logger="gpulens"), gpulens.Monitor(
        interval=0.05, sinks=[sink], backend=SimulatedNVML(gpus=1, load=load)
    ) as mon:
        _run(mon, 8, 0.1)
    assert any("sampler failed" in r.message for r in caplog.records)
    assert [r.step for r in sink.rows] == list(range(1, 9))


def test_failing_sink_is_retried_then_counted(caplog: pytest.LogCaptureFixture) -> None:
    flaky, good = MemorySink(), MemorySink()
    flaky.fail = True
    mon = gpulens.Monitor(interval=0.05, sinks=[flaky, good], backend=SimulatedNVML(gpus=1),
                          buffer_rows=4)
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        mon.start()
        for step in range(1, 7):  # two bursts of three rows, each finished after a slow read
            mon.log(step)
            if step % 3 == 0:
                time.sleep(1.6)
        flaky.fail = False  # the tracker comes back: the buffered rows are delivered
        time.sleep(1.5)
        stats = mon.stop(timeout=2)
    assert [r.step for r in good.rows] == [1, 2, 3, 4, 5, 6]
    st = stats["MemorySink"]
    assert st.failures >= 1
    # the buffer held 4 rows: the two oldest were dropped and counted, the rest delivered late
    assert [r.step for r in flaky.rows] == [3, 4, 5, 6]
    assert (st.written, st.dropped) == (4, 2)
    assert stats["MemorySink#2"].dropped == 0
    assert any("failed to write" in r.message for r in caplog.records)
    assert any("4 rows written, 2 dropped" in r.message for r in caplog.records)


def test_memory_is_bounded_over_many_rows() -> None:
    sink = MemorySink()
    mon = gpulens.Monitor(interval=0.01, sinks=[], backend=SimulatedNVML(gpus=1))
    mon.start()
    try:
        for step in range(1, 20_001):
            mon.log(step)
            if step % 2000 == 0:
                time.sleep(0.05)
        sampler = mon._sampler
        assert sampler is not None
        time.sleep(1.5)
        gpu = sampler.gpus[0]
        assert len(sampler.marks) < 20_000
        assert len(gpu.fast) < 5_000 and len(gpu.power_fast) < 5_000
        assert len(gpu.power_buf) < 5_000
    finally:
        mon.stop()
    del sink
