"""The NVML door, driven by the simulated library (same code as on hardware)."""

from __future__ import annotations

import logging

import pytest

from gpulens.errors import GpuLost, NvmlUnavailable
from gpulens.sources.nvml import POWER_SAMPLES, UTIL_SAMPLES, NvmlSource, parse_visible_devices
from gpulens.testing import SimulatedNVML


def _open(sim: SimulatedNVML) -> NvmlSource:
    src = NvmlSource(sim)
    src.open()
    return src


def test_fast_read_units_and_consistency() -> None:
    sim = SimulatedNVML(gpus=1, load=lambda g, t: 0.5)
    dev = _open(sim).device(0)
    r = dev.read_fast()
    assert r.power_w == pytest.approx(sim.IDLE_W + 0.5 * (sim.MAX_W - sim.IDLE_W), rel=1e-3)
    assert r.power_limit_w == 700.0
    assert r.mem_used_gb is not None and r.mem_pct is not None
    assert 0 < r.mem_used_gb <= sim.MEM_TOTAL / 1e9
    assert r.util_pct == pytest.approx(52.0, abs=1)
    info = dev.info(0)
    assert info.uuid.startswith("GPU-") and info.mem_total_gb == pytest.approx(85.899, rel=1e-3)


def test_not_supported_is_remembered_and_never_retried() -> None:
    sim = SimulatedNVML(gpus=2, not_supported={1: {"nvmlDeviceGetPowerUsage"}})
    src = _open(sim)
    d0, d1 = src.device(0), src.device(1)
    for _ in range(5):
        assert d1.read_fast().power_w is None
        assert d0.read_fast().power_w is not None
    # GPU 1's power read was tried once, GPU 0's five times
    assert sim.calls["nvmlDeviceGetPowerUsage"] == 6
    assert not d1.supports("power") and d0.supports("power")


def test_gpu_lost_raises_gpulost() -> None:
    sim = SimulatedNVML(gpus=1, lose_gpu_after={0: 0.0})
    dev = _open(sim).device(0)
    with pytest.raises(GpuLost):
        dev.read_fast()
    with pytest.raises(GpuLost):
        dev.read_energy_mj()


def test_no_driver_is_nvml_unavailable() -> None:
    with pytest.raises(NvmlUnavailable):
        NvmlSource(SimulatedNVML(driver_loaded=False)).open()


def test_buffered_samples_arrive_once_with_unix_timestamps() -> None:
    import time

    sim = SimulatedNVML(gpus=1)
    dev = _open(sim).device(0)
    time.sleep(0.3)
    first = dev.read_samples(POWER_SAMPLES)
    assert len(first) >= 10  # a sample every 20 ms
    assert abs(first[-1][0] - time.time()) < 1.0
    assert all(sim.IDLE_W <= v <= sim.MAX_W for _, v in first)
    again = dev.read_samples(POWER_SAMPLES)
    assert all(t > first[-1][0] for t, _ in again)
    assert dev.read_samples(UTIL_SAMPLES)


def test_gpm_between_two_refreshes() -> None:
    now = [0.0]
    sim = SimulatedNVML(gpus=1, load=lambda g, t: 0.8, clock=lambda: now[0])
    phase = sim.gpm_phase_s  # refreshes at phase + k * 0.1
    dev = _open(sim).device(0)
    now[0] = phase + 0.15
    assert dev.read_gpm() is None  # the first call only takes a sample
    now[0] = phase + 0.45  # three refreshes later
    got = dev.read_gpm()
    assert got is not None
    start, end, values = got
    assert end > start
    assert values["sm_active_pct"] == pytest.approx(80.0, abs=1.0)
    assert set(values) == {"sm_active_pct", "sm_occupancy_pct", "tensor_active_pct",
                           "nvlink_rx_gb_per_s", "nvlink_tx_gb_per_s", "pcie_rx_gb_per_s",
                           "pcie_tx_gb_per_s",
                           "dram_bw_pct"}


def test_gpm_right_after_the_epoch_over_many_phases_and_delays() -> None:
    """A first sample taken before ``gpm_delay_s`` has passed holds activity from the epoch on
    only; the mean over what the samples hold is still the load.  (The simulator once divided
    by whole refresh periods there, and ``test_gpm_between_two_refreshes``, whose seed is
    drawn afresh, read 78.6 % for 80 % in a ``make test`` run.)"""
    now = [0.0]
    for seed in range(400):
        now[0] = 0.0
        sim = SimulatedNVML(gpus=1, load=lambda g, t: 0.8, clock=lambda: now[0], seed=seed)
        dev = _open(sim).device(0)
        now[0] = sim.gpm_phase_s + 0.15
        assert dev.read_gpm() is None
        now[0] = sim.gpm_phase_s + 0.45
        got = dev.read_gpm()
        assert got is not None, seed
        assert got[2]["sm_active_pct"] == pytest.approx(80.0, abs=0.5), (seed, sim.gpm_delay_s)


def test_gpm_without_a_refresh_keeps_the_earlier_sample() -> None:
    """Two samples between the same refreshes read 0 % (DRAM NaN): that is no figure at all,
    and the next span runs from the kept sample."""
    now = [0.0]
    sim = SimulatedNVML(gpus=1, load=lambda g, t: 1.0, clock=lambda: now[0])
    phase = sim.gpm_phase_s  # refreshes at phase + k * 0.1
    dev = _open(sim).device(0)
    now[0] = phase + 0.31
    dev.read_gpm()
    now[0] = phase + 0.33  # same refresh period as the kept sample
    assert dev.read_gpm() is None
    now[0] = phase + 0.36
    assert dev.read_gpm() is None
    now[0] = phase + 0.52  # two refreshes after the kept sample
    got = dev.read_gpm()
    assert got is not None
    assert got[2]["sm_active_pct"] == pytest.approx(100.0, abs=0.5)  # not 0, not 2x


def test_no_gpm_is_remembered() -> None:
    sim = SimulatedNVML(gpus=1, gpm=False)
    dev = _open(sim).device(0)
    assert dev.read_gpm() is None and dev.read_gpm() is None
    assert "nvmlGpmSampleGet" not in sim.calls


@pytest.mark.parametrize(
    ("env", "expected"),
    [(None, [0, 1, 2]), ("2,0", [2, 0]), ("1,7,0", [1]), ("", []), ("-1", []),
     ("GPU-5105a7ed-0000-4000-8000-000000000002", [2]), ("0,GPU-nope", [0])],
)
def test_cuda_visible_devices(
    env: str | None, expected: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    if env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert _open(SimulatedNVML(gpus=3)).visible_nvml_indices() == expected


def test_parse_visible_devices() -> None:
    assert parse_visible_devices(None) is None
    assert parse_visible_devices(" 1, 0 ") == ["1", "0"]


def test_mig_instances_map_to_their_parent_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = SimulatedNVML(gpus=2, mig={1: ["3g.40gb", "4g.40gb"]})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{sim.mig_uuid(1, 1)},0")
    (first, second) = _open(sim).visible_gpus()
    assert first.nvml_index == 1 and first.mig is not None
    assert "4g.40gb" in first.mig and sim.mig_uuid(1, 1) in first.mig
    assert second.nvml_index == 0 and second.mig is None
    # the older form names the parent GPU and the GPU instance
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"MIG-{sim.gpu_uuid(1)}/3/0")
    (old,) = _open(sim).visible_gpus()
    assert old.nvml_index == 1 and old.mig is not None and "instance 3" in old.mig


def test_an_entry_that_matches_nothing_is_a_warning_naming_what_exists(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    sim = SimulatedNVML(gpus=1, mig={0: ["7g.80gb"]})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0000dead")
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        assert _open(sim).visible_gpus() == []
    assert "'MIG-0000dead' matches no GPU" in caplog.text
    assert sim.gpu_uuid(0) in caplog.text and sim.mig_uuid(0, 0) in caplog.text


def test_enumeration_goes_through_the_door(monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """An NVML error while listing GPUs is a warning and an empty list, never an exception
    out of the engine's start."""
    sim = SimulatedNVML(gpus=2, fail_after={1: {"nvmlDeviceGetUUID": 0.0}})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", sim.gpu_uuid(1))
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        assert _open(sim).visible_gpus() == []
    assert "NVML uuid failed" in caplog.text


def test_the_energy_counter_update_period_is_probed() -> None:
    sim = SimulatedNVML(gpus=1, energy_latency_s=(0.001, 0.002))
    dev = _open(sim).device(0)
    got = dev.probe_energy_update(0.5)
    assert got is not None and got == pytest.approx(sim.ENERGY_PERIOD, abs=0.01)
    assert _open(SimulatedNVML(gpus=1, not_supported={0: {
        "nvmlDeviceGetTotalEnergyConsumption"}})).device(0).probe_energy_update(0.2) is None
