"""Step windows: time-weighted means, interval spans, stale columns and calibrated energy."""

from __future__ import annotations

import itertools
import math

import pytest

from gpulens.engine.window import (
    NO_COUNTER_REL_ERR,
    CalibratedEnergy,
    IntervalSeries,
    Series,
    Table,
    job_aggregates,
)


def _series(points: list[tuple[float, float]]) -> Series:
    s = Series()
    s.extend(points)
    return s


def test_time_weighted_mean_is_trapezoid_over_window() -> None:
    s = _series([(0.0, 0.0), (1.0, 100.0), (2.0, 100.0)])
    st = s.stat(0.0, 2.0, stale=1.0)
    assert st is not None
    # integral: 50 (ramp) + 100 (flat) over 2 s
    assert st.mean == pytest.approx(75.0)
    assert st.max == 100.0
    assert st.inside == 2  # 0.0 and 1.0 lie in [0, 2); 2.0 does not


def test_max_is_never_below_mean() -> None:
    # the inside sample (10) is lower than the interpolated edges (ramps from/to 100)
    s = _series([(0.0, 100.0), (1.0, 10.0), (2.0, 100.0)])
    for a, b in ((0.1, 1.9), (0.5, 1.2), (0.9, 1.05)):
        st = s.stat(a, b, stale=1.0)
        assert st is not None and st.max >= st.mean


def test_window_between_samples_interpolates() -> None:
    s = _series([(0.0, 0.0), (1.0, 100.0)])
    st = s.stat(0.25, 0.75, stale=1.0)
    assert st is not None
    assert st.mean == pytest.approx(50.0)
    assert st.inside == 0


def test_stale_series_is_absent_not_zero() -> None:
    s = _series([(0.0, 10.0)])
    assert s.stat(5.0, 6.0, stale=1.0) is None
    assert Series().stat(0.0, 1.0, stale=1.0) is None


def test_series_is_bounded() -> None:
    s = Series(capacity=1000)
    for i in range(10_000):
        s.add(float(i), 1.0)
    assert len(s) <= 1000
    s.trim_before(9_990.0)
    assert s.t[0] <= 9_990.0 and len(s) < 1000


def test_out_of_order_samples_are_ignored() -> None:
    s = _series([(1.0, 1.0), (0.5, 5.0), (2.0, 2.0)])
    assert s.t == [1.0, 2.0]


def test_interval_series_overlap_weighted() -> None:
    g = IntervalSeries()
    g.add(0.0, 1.0, {"sm_active_pct": 100.0})
    g.add(1.0, 2.0, {"sm_active_pct": 0.0})
    assert g.means(0.5, 1.5)["sm_active_pct"] == pytest.approx(50.0)
    assert g.means(0.0, 0.2)["sm_active_pct"] == pytest.approx(100.0)
    # a window past the last span takes the nearest span's values
    assert g.means(2.1, 2.2)["sm_active_pct"] == pytest.approx(0.0)
    assert g.means(10.0, 11.0) == {}


def _calibrated(power: Series, reads: list[tuple[float, float]], update_s: float = 0.1
                ) -> CalibratedEnergy:
    energy = CalibratedEnergy(power, update_s)
    for t, mj in reads:
        energy.add_counter(t + update_s / 2, mj)  # reads placed at t
    return energy


def test_energy_scale_comes_from_the_counter_and_shape_from_power() -> None:
    """The power samples read 10 % low; a minute of counter reads says so; each window keeps
    the power curve's shape and the windows add up to the counter."""
    power = _series([(0.0, 90.0), (0.5, 90.0), (0.5000001, 450.0), (61.0, 450.0)])
    true = [(float(t), 1000 * power.integral(0.0, float(t)) / 0.9) for t in range(61)]
    energy = _calibrated(power, true)
    k, rel = energy.scale()
    assert k == pytest.approx(1 / 0.9, rel=0.002)
    assert rel < 0.002  # a minute's span: 0.1 s of staleness at 450 W over ~27 kJ
    edges = [i / 20 for i in range(1201)]  # 50 ms windows, shorter than a counter update
    parts = [energy.window(a, b) for a, b in itertools.pairwise(edges)]
    assert all(p is not None and p[0] > 0 and p[1] >= 0 for p in parts)
    assert sum(p[0] for p in parts if p is not None) == pytest.approx(true[-1][1] / 1000,
                                                                      rel=0.002)
    first_half_s = sum(p[0] for p in parts[:10] if p is not None)
    assert first_half_s == pytest.approx(45.0 * k, rel=1e-3)  # 90 W for 0.5 s, scaled


def test_a_short_calibration_span_moves_the_scale_little() -> None:
    """Two reads 3 s apart, each maybe 100 ms stale: the span's k is weighed against the
    power samples' own scale by their uncertainties."""
    power = _series([(0.0, 450.0), (3.0, 450.0)])
    energy = _calibrated(power, [(0.0, 0.0), (3.0, 3 * 450 / 0.9 * 1000)])
    k, rel = energy.scale()
    u_span = 0.1 * 450 / (3 * 450)
    w_prior, w_span = 1 / NO_COUNTER_REL_ERR**2, 1 / u_span**2
    assert k == pytest.approx((w_prior + w_span / 0.9) / (w_prior + w_span))
    assert 1.0 < k < 1 / 0.9 and rel == pytest.approx((w_prior + w_span) ** -0.5)


def test_energy_before_a_calibration_span_is_the_power_integral_with_a_stated_bound() -> None:
    power = _series([(0.0, 100.0), (2.0, 100.0)])
    energy = CalibratedEnergy(power)
    got = energy.window(0.5, 1.5)
    assert got is not None
    assert got[0] == pytest.approx(100.0)
    assert got[1] == pytest.approx(100.0 * NO_COUNTER_REL_ERR)
    assert CalibratedEnergy(Series()).window(0.5, 1.5) is None


def test_energy_stale_counter_reads_do_not_make_steps_jump() -> None:
    """Each read is up to 100 ms stale: a span-by-span calibration would swing ~10 % step to
    step on a load that jumps; the scale over a long span barely moves."""
    period = 0.6
    samples = [(i * 0.02, 700.0 if (i * 0.02) % period >= period / 2 else 70.0)
               for i in range(0, 1500)]
    power = _series(samples)
    energy = CalibratedEnergy(power, 0.1)
    ks = []
    for n in range(1, 30):
        read_at = n * 1.0
        stale_to = math.floor((read_at - 0.037) / 0.1) * 0.1 + 0.037  # 100 ms updates
        energy.add_counter(read_at, power.integral(0.0, stale_to) * 1000)
        if n > 5:
            ks.append(energy.scale()[0])
    assert max(ks) - min(ks) < 0.01
    assert all(abs(k - 1) < 0.02 for k in ks)


def test_energy_counter_reset_starts_the_calibration_afresh() -> None:
    power = _series([(0.0, 50.0), (5.0, 50.0)])
    energy = _calibrated(power, [(0.0, 900_000.0), (1.0, 950_000.0), (2.0, 10.0)])
    assert energy.scale() == (1.0, NO_COUNTER_REL_ERR)  # one read since the reset
    energy.add_counter(3.05, 50_010.0)
    assert energy.scale()[0] == pytest.approx(1.0)


def test_a_column_that_stops_reading_is_absent_not_held() -> None:
    table = Table()
    for i in range(10):
        t = i * 0.1
        table.add_row(t, {"temp_c": 40.0, "mem_used_gb": 1.0} if t < 0.45 else
                      {"mem_used_gb": 1.0})
    got = table.window(0.9, 1.0, stale=0.3)
    assert got is not None
    assert "mem_used_gb" in got[0] and "temp_c" not in got[0]
    early = table.window(0.2, 0.4, stale=0.3)
    assert early is not None and early[0]["temp_c"].mean == pytest.approx(40.0)


def test_job_aggregates() -> None:
    out = job_aggregates([{"power_w": 100.0, "samples": 3.0, "power_limit_w": 700.0},
                          {"power_w": 300.0}])
    assert out == {"gpu/all/power_w_mean": 200.0, "gpu/all/power_w_min": 100.0,
                   "gpu/all/power_w_max": 300.0}
    assert job_aggregates([{"power_w": 1.0}]) == {}
    assert not any(math.isnan(v) for v in out.values())
