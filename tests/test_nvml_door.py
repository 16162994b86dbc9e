"""The NVML door, driven by the simulated library (same code as on hardware)."""

from __future__ import annotations

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
    dev = _open(sim).device(0)
    now[0] = 0.15
    assert dev.read_gpm() is None  # the first call only takes a sample
    now[0] = 0.45  # three refreshes later
    got = dev.read_gpm()
    assert got is not None
    start, end, values = got
    assert end > start
    assert values["sm_active_pct"] == pytest.approx(80.0, abs=1.0)
    assert set(values) == {"sm_active_pct", "sm_occupancy_pct", "tensor_active_pct",
                           "dram_bw_pct"}


def test_gpm_without_a_refresh_keeps_the_earlier_sample() -> None:
    """Two samples between the same refreshes read 0 % (DRAM NaN): that is no figure at all,
    and the next span runs from the kept sample."""
    now = [0.0]
    sim = SimulatedNVML(gpus=1, load=lambda g, t: 1.0, clock=lambda: now[0])
    dev = _open(sim).device(0)
    now[0] = 0.31
    dev.read_gpm()
    now[0] = 0.33  # same refresh period as the kept sample
    assert dev.read_gpm() is None
    now[0] = 0.36
    assert dev.read_gpm() is None
    now[0] = 0.52  # two refreshes after the kept sample
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
