"""NVLink and PCIe rates and the memory clock through the NVML door: GPM's rates where the GPU
has them (MiB/s given as GB/s), NVML's cumulative counters (summed over links) elsewhere; absent
where neither answers, never 0."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpulens.sources.nvml import NvmlSource
from gpulens.testing import SimulatedNVML


@dataclass
class _Field:
    fieldId: int
    scopeId: int
    nvmlReturn: int
    valueType: int = 3  # unsigned long long
    value: Any = None


@dataclass
class _Value:
    ullVal: int


class Linked(SimulatedNVML):
    """Simulated GPUs with NVLink data counters on links 0-3 (KiB) and PCIe byte counters
    that the test advances by hand."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.kib = 0
        self.pcie = 0

    def nvmlDeviceGetFieldValues(self, h: Any, fields: list[tuple[int, int]]) -> list[_Field]:
        out = []
        for field_id, scope in fields:
            if field_id in (138, 139):
                ok = scope < 4  # a GPU with 4 links: the others answer with an error
                out.append(_Field(field_id, scope, 0 if ok else 2, value=_Value(self.kib)))
            else:
                out.append(_Field(field_id, scope, 0, value=_Value(self.pcie)))
        return out


def _device(lib: Any) -> Any:
    source = NvmlSource(lib)
    source.open()
    return source.device(0)


def test_counter_rates_sum_the_links() -> None:
    lib = Linked(gpus=1)
    dev = _device(lib)
    assert dev.read_fast().links is None  # the first read: no rate yet
    lib.kib += 1_000_000  # per link
    lib.pcie += 2_000_000_000
    r = dev.read_fast()
    assert r.links is not None
    dt_rates = r.links
    # 4 links x 1e6 KiB each way, 2e9 bytes of PCIe each way, over the time between reads
    ratio = dt_rates["nvlink_rx_gb_per_s"] / dt_rates["pcie_rx_gb_per_s"]
    assert abs(ratio - 4 * 1_000_000 * 1024 / 2e9) < 1e-6
    assert set(dt_rates) == {"nvlink_rx_gb_per_s", "nvlink_tx_gb_per_s", "pcie_rx_gb_per_s",
                             "pcie_tx_gb_per_s"}


def test_no_counters_no_rates() -> None:
    dev = _device(SimulatedNVML(gpus=1))  # no field values at all
    dev.read_fast()
    assert dev.read_fast().links is None


class GpmLinked(SimulatedNVML):
    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        request = super().nvmlGpmMetricsGet(request)
        for m in request.metrics[: request.numMetrics]:
            if m.metricId == 60:  # NVLink RX, MiB/s
                m.value, m.nvmlReturn = 1000.0, 0
            elif m.metricId == 21:  # PCIe RX: this GPU does not answer it
                m.nvmlReturn = 3
        return request


def test_gpm_rates_in_gb_per_s() -> None:
    import time

    lib = GpmLinked(gpus=1)
    dev = _device(lib)
    got = None
    deadline = time.monotonic() + 30
    while got is None:  # two GPM samples a refresh apart
        assert time.monotonic() < deadline
        got = dev.read_gpm()
        time.sleep(0.02)
    values = got[2]
    assert abs(values["nvlink_rx_gb_per_s"] - 1000 * 1.048576e-3) < 1e-9
    assert "pcie_rx_gb_per_s" not in values  # not answered: absent, never 0
    # the plain simulator: NVLink a measured 0 (no peers), PCIe a little while busy
    plain = _device(SimulatedNVML(gpus=1))
    got = None
    while got is None:
        assert time.monotonic() < deadline
        got = plain.read_gpm()
        time.sleep(0.02)
    assert got[2]["nvlink_rx_gb_per_s"] == 0.0 and got[2]["pcie_rx_gb_per_s"] >= 0.0
