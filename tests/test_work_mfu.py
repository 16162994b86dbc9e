"""gpulens.work.mfu: the perf/* keys of one window, worked by hand."""

from __future__ import annotations

import itertools
import math

import pytest

from gpulens.work.mfu import PERF_KEYS, window_flops, window_perf


def test_a_window_by_hand() -> None:
    # 4 steps of 8 GPUs x one 4096-token sequence in 2.5 s, Llama-3-8B at 51.47 GFLOP/token
    # (training), H100 SXM bf16 989.4 TFLOP/s, SM clock 1755 of 1980 MHz, 690 W a GPU.
    tokens = 4 * 8 * 4096
    out = window_perf(seconds=2.5, gpus=8, tokens=tokens, steps=4, flops_per_token=51.47e9,
                      peak_tflops=989.4, mean_sm_clock_mhz=1755.0, max_sm_clock_mhz=1980.0,
                      energy_j=8 * 2.5 * 690.0, tensor_active_pct=80.0, dtype="bf16")
    per_gpu = tokens * 51.47e9 / 2.5 / 8 / 1e12
    mfu = 100 * per_gpu / 989.4
    assert out == pytest.approx({
        "perf/tokens_per_s": tokens / 2.5,
        "perf/tflops": per_gpu,
        "perf/tflops_job": per_gpu * 8,
        "perf/mfu_pct": mfu,
        "perf/mfu_clock_adjusted_pct": mfu * 1980.0 / 1755.0,
        "perf/tokens_per_j": tokens / (8 * 2.5 * 690.0),
        "perf/mfu_when_tensor_active_pct": mfu / 0.80,
    })
    assert 34 < out["perf/mfu_pct"] < 35
    assert set(out) <= set(PERF_KEYS)


def test_absent_inputs_give_absent_keys() -> None:
    assert window_perf(seconds=1.0) == {}
    only_tokens = window_perf(seconds=2.0, tokens=100.0)
    assert only_tokens == {"perf/tokens_per_s": 50.0}
    no_peak = window_perf(seconds=2.0, tokens=100.0, flops_per_token=1e12)
    assert set(no_peak) == {"perf/tokens_per_s", "perf/tflops", "perf/tflops_job"}
    no_clock = window_perf(seconds=1.0, flops=1e12, peak_tflops=10.0, mean_sm_clock_mhz=1500)
    assert set(no_clock) == {"perf/tflops", "perf/tflops_job", "perf/mfu_pct"}
    assert no_clock["perf/mfu_pct"] == pytest.approx(10.0)
    nan = window_perf(seconds=1.0, tokens=math.nan, flops=math.nan, energy_j=math.nan)
    assert nan == {}
    # No energy figure, or none spent: no work per joule (never a 0 or an infinity).
    assert "perf/tokens_per_j" not in window_perf(seconds=1.0, tokens=5.0, energy_j=0.0)
    # GPM absent (pre-Hopper) or tensor pipes idle: no comparison.
    for tensor in (None, 0.0):
        out = window_perf(seconds=1.0, flops=1e12, peak_tflops=10.0, tensor_active_pct=tensor,
                          dtype="bf16")
        assert "perf/mfu_when_tensor_active_pct" not in out
    # A window of no length has no rate.
    assert window_perf(seconds=0.0, tokens=10.0, flops=1e9, peak_tflops=1.0) == {}


def test_zero_work_is_a_measurement() -> None:
    out = window_perf(seconds=1.0, tokens=0.0, flops_per_token=1e9, peak_tflops=100.0,
                      energy_j=50.0)
    assert out["perf/tokens_per_s"] == 0.0
    assert out["perf/mfu_pct"] == 0.0
    assert out["perf/tokens_per_j"] == 0.0


def test_clock_adjusted_never_above_the_datasheet() -> None:
    base = {"seconds": 1.0, "flops": 5e14, "peak_tflops": 1000.0, "max_sm_clock_mhz": 1980.0}
    slow = window_perf(mean_sm_clock_mhz=990.0, **base)
    assert slow["perf/mfu_pct"] == pytest.approx(50.0)
    assert slow["perf/mfu_clock_adjusted_pct"] == pytest.approx(100.0)
    fast = window_perf(mean_sm_clock_mhz=2100.0, **base)  # above max: the peak is not raised
    assert fast["perf/mfu_clock_adjusted_pct"] == pytest.approx(50.0)


def test_samples_and_flops_sources() -> None:
    out = window_perf(seconds=4.0, samples=64.0, flops_per_sample=2e12, energy_j=800.0,
                      peak_tflops=100.0, gpus=2)
    assert out["perf/samples_per_s"] == 16.0
    assert out["perf/samples_per_j"] == 0.08
    assert out["perf/tflops"] == pytest.approx(64 * 2e12 / 4.0 / 2 / 1e12)
    assert "perf/tokens_per_s" not in out
    # Counted FLOPs win over a per-token estimate; per step is the last resort.
    assert window_flops(flops=7.0, tokens=10.0, flops_per_token=100.0) == 7.0
    assert window_flops(tokens=10.0, flops_per_token=100.0, steps=2, flops_per_step=1.0) == 1e3
    assert window_flops(steps=2, flops_per_step=3.0) == 6.0
    assert window_flops(tokens=10.0) is None


def test_tensor_cores_busy_but_slow_versus_idle() -> None:
    busy_slow = window_perf(seconds=1.0, flops=3e14, peak_tflops=1000.0, tensor_active_pct=90.0,
                            dtype="bf16")
    idle = window_perf(seconds=1.0, flops=3e14, peak_tflops=1000.0, tensor_active_pct=32.0,
                       dtype="bf16")
    assert busy_slow["perf/mfu_when_tensor_active_pct"] == pytest.approx(33.3, abs=0.1)
    assert idle["perf/mfu_when_tensor_active_pct"] == pytest.approx(93.75)


def test_mfu_while_tensor_cores_busy_is_a_share_or_absent() -> None:
    """A percentage stays within 0-100: no figure for a dtype off the tensor cores (an FP32 run's
    MFU over stray tensor activity read 302-407 % on two H200s), none above 100 % (the inputs
    disagree: reported to the caller), never a clamped 100."""
    base = {"seconds": 1.0, "flops": 2e13, "peak_tflops": 67.0, "tensor_active_pct": 8.0}
    for dtype in ("fp32", "fp64", None):
        out = window_perf(**base, dtype=dtype)  # type: ignore[arg-type]
        assert out["perf/mfu_pct"] == pytest.approx(29.85, abs=0.01)
        assert "perf/mfu_when_tensor_active_pct" not in out
    over: list[float] = []
    out = window_perf(**base, dtype="tf32", out_of_range=over)  # 29.85 % MFU, 8 % busy
    assert "perf/mfu_when_tensor_active_pct" not in out and out["perf/mfu_pct"] > 0
    assert over == [pytest.approx(373.1, abs=0.1)]
    edge = window_perf(seconds=1.0, flops=5e14, peak_tflops=1000.0, tensor_active_pct=50.0,
                       dtype="fp16")
    assert edge["perf/mfu_when_tensor_active_pct"] == pytest.approx(100.0)


def test_the_engine_tells_once_when_the_tensor_share_is_left_out(
        caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from gpulens.engine.finish import Finisher
    from gpulens.engine.spec import EngineSpec
    from gpulens.model import GpuInfo, Row

    gpu = GpuInfo(index=0, name="Simulated H100 80GB HBM3", uuid="GPU-0", pci_bus_id="0:0",
                  mem_total_gb=80.0, power_limit_w=700.0)
    finisher = Finisher(EngineSpec(interval=0.1, dtype="bf16"), [gpu])
    assert finisher.peak_tflops is not None
    caplog.set_level(logging.WARNING, logger="gpulens")
    rows = []
    for step, tensor in enumerate((40.0, 1.0, 1.0, 40.0), start=1):
        rows.append(finisher.finish(Row(step=step, time=float(step), values={
            "perf/step_time_s": 1.0, "perf/steps": 1.0, "gpu/0/tensor_active_pct": tensor,
            "work/flops": 0.2 * finisher.peak_tflops * 1e12})).values)
    shares = [r.get("perf/mfu_when_tensor_active_pct") for r in rows]
    assert shares[0] == pytest.approx(50.0) and shares[3] == pytest.approx(50.0)
    assert shares[1] is None and shares[2] is None  # 20 % MFU while busy 1 % of the time
    assert all(r["perf/mfu_pct"] == pytest.approx(20.0) for r in rows)
    told = [r for r in caplog.records if "mfu_when_tensor_active_pct" in r.getMessage()]
    assert len(told) == 1 and "step 2" in told[0].getMessage()


@pytest.mark.parametrize("kwargs", [
    {"seconds": 1.0, "tokens": -1.0},
    {"seconds": 1.0, "flops": math.inf},
    {"seconds": 1.0, "gpus": 0},
    {"seconds": -1.0},
    {"seconds": 1.0, "energy_j": -5.0},
])
def test_bad_inputs_are_user_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        window_perf(**kwargs)  # type: ignore[arg-type]


def test_rows_whose_gpm_spans_hold_the_start_get_no_tensor_share(
        caplog: pytest.LogCaptureFixture) -> None:
    """A monitor started mid-training: the GPU idles through the start, and GPM's first spans
    (0.25 s each at a 0.5 s interval) hold that idle time, while the rows inside them are
    busy steps. Their quotient read 100-215 % on an H200; such rows get no
    ``perf/mfu_when_tensor_active_pct`` (and no warning), the rows after them do."""
    import logging
    from typing import Any, cast

    from gpulens.engine.finish import Finisher
    from gpulens.engine.sampler import GpuState, Sampler
    from gpulens.engine.spec import WORK_FLOPS, EngineSpec
    from gpulens.model import GpuInfo, Mark, Row

    info = GpuInfo(index=0, name="Simulated H100 80GB HBM3", uuid="GPU-0", pci_bus_id="0:0",
                   mem_total_gb=80.0, power_limit_w=700.0)
    finisher = Finisher(EngineSpec(interval=0.5, dtype="bf16"), [info])
    assert finisher.peak_tflops is not None
    state = GpuState(key=0, device=cast(Any, None), info=info, torch_index=None)
    for k in range(40):
        state.fast.add_row(99.9 + 0.1 * k, {"sm_clock_mhz": 1980.0})
    edges = [99.9 + 0.25 * k for k in range(12)]
    for k, (a, b) in enumerate(itertools.pairwise(edges)):
        state.gpm.add(a, b, {"tensor_active_pct": (5.0, 60.0)[k] if k < 2 else 93.0})
    rows: list[Row] = []
    sampler = Sampler([state], interval=0.5, emit=rows.append)
    sampler._window_start, sampler._first_end, sampler._gpm_settled = 100.0, 0.0, False
    step_s, flops = 0.115, 0.8 * finisher.peak_tflops * 1e12 * 0.115  # 80 % MFU
    caplog.set_level(logging.WARNING, logger="gpulens")
    ends = [100.2 + step_s * k for k in range(12)]
    out = [finisher.finish(sampler._row(Mark(step, t, t, {WORK_FLOPS: flops}))).values
           for step, t in enumerate(ends, start=1)]
    shares = [r.get("perf/mfu_when_tensor_active_pct") for r in out]
    assert shares[:3] == [None, None, None], shares  # their spans began before the first end
    assert all(s == pytest.approx(80.0 / 0.93) for s in shares[4:]), shares
    assert all("work/gpm_from_start" not in r for r in out)
    assert not [r for r in caplog.records if "mfu_when_tensor_active" in r.getMessage()]
