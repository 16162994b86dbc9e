"""Step windows: time-weighted means, interval spans and counter-anchored energy."""

from __future__ import annotations

import itertools
import math

import pytest

from gpulens.engine.window import IntervalSeries, Series, job_aggregates, window_energy_j


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


def test_energy_long_window_is_exact_counter_difference() -> None:
    counter = _series([(0.0, 0.0), (1.0, 500_000.0), (2.0, 700_000.0)])  # mJ
    power = _series([(0.0, 500.0), (1.0, 500.0), (1.001, 200.0), (2.0, 200.0)])
    assert window_energy_j(counter, power, 0.0, 2.0) == pytest.approx(700.0)


def test_energy_short_windows_share_the_counter_by_power_and_add_up() -> None:
    counter = _series([(0.0, 0.0), (1.0, 300_000.0)])  # 300 J over the second
    # power: 100 W in the first half, 500 W in the second
    power = _series([(0.0, 100.0), (0.5, 100.0), (0.5000001, 500.0), (1.0, 500.0)])
    edges = [i / 20 for i in range(21)]  # 50 ms windows, shorter than a counter update
    parts = [window_energy_j(counter, power, a, b) for a, b in itertools.pairwise(edges)]
    assert all(p is not None and p > 0 for p in parts)
    assert sum(p for p in parts if p is not None) == pytest.approx(300.0)
    first_half = sum(p for p in parts[:10] if p is not None)
    assert first_half == pytest.approx(50.0, rel=1e-3)  # 100/(100+500) of 300 J


def test_energy_without_counter_integrates_power() -> None:
    power = _series([(0.0, 100.0), (2.0, 100.0)])
    assert window_energy_j(Series(), power, 0.5, 1.5) == pytest.approx(100.0)
    assert window_energy_j(Series(), None, 0.5, 1.5) is None


def test_energy_counter_reset_falls_back_to_power() -> None:
    counter = _series([(0.0, 900_000.0), (1.0, 10.0)])
    power = _series([(0.0, 50.0), (1.0, 50.0)])
    assert window_energy_j(counter, power, 0.0, 1.0) == pytest.approx(50.0)


def test_job_aggregates() -> None:
    out = job_aggregates([{"power_w": 100.0, "samples": 3.0, "power_limit_w": 700.0},
                          {"power_w": 300.0}])
    assert out == {"gpu/all/power_w_mean": 200.0, "gpu/all/power_w_min": 100.0,
                   "gpu/all/power_w_max": 300.0}
    assert job_aggregates([{"power_w": 1.0}]) == {}
    assert not any(math.isnan(v) for v in out.values())
