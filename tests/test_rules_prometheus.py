"""The Prometheus alert rules agree with the rule engine: every alert that mirrors an engine rule
(label ``rule``) is built from the thresholds and shares of ``gpulens.engine.rules.RULES`` and
the Prometheus sink's series names, and promtool, fed the same series as the engine, fires and
clears at the same moments."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gpulens.engine.rules import ACTIVE_PCT, RULES, RuleEngine, RulesConfig, Threshold
from gpulens.model import GpuInfo
from gpulens.sinks.prometheus import GPU_SERIES, THROTTLE_SERIES, scalar_series_name
from tests.test_prometheus import binary

ROOT = Path(__file__).resolve().parents[1]
RULES_YML = ROOT / "integrations" / "prometheus" / "gpulens-rules.yml"
RANGE = "[5m]"
GPU_ON = "on(gpu, host, instance, job)"


def _alerts() -> dict[str, dict[str, object]]:
    groups = yaml.safe_load(RULES_YML.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def _norm(expr: str) -> str:
    return re.sub(r"\s+", " ", expr).replace("( ", "(").replace(" )", ")").strip()


def _fire(series: str, t: Threshold, share: float) -> str:
    """>= ``share`` of the samples at fire level (the engine's fire rule)."""
    q = 1 - share if t.op == ">=" else share
    return f"quantile_over_time({q:g}, {series}) {t.op} {t.fire:g}"


def _keep(series: str, t: Threshold, share: float) -> str:
    """Not yet >= ``share`` of the samples at clear level (the engine keeps firing)."""
    q = share if t.op == ">=" else 1 - share
    return f"quantile_over_time({q:g}, {series}) {t.op} {t.clear:g}"


def _firing(alert: str) -> str:
    return f'ALERTS{{alertname="{alert}", alertstate="firing"}}'


def _gauge(suffix: str) -> str:
    return GPU_SERIES[suffix][0]


def _throttle(suffix: str) -> str:
    return f'gpulens_gpu_clocks_throttled_percent{{reason="{THROTTLE_SERIES[suffix]}"}}'


def _one(alert: str, rule: str, threshold: str, series: str, on: str = GPU_ON) -> str:
    spec = RULES[rule]
    t = spec.threshold(threshold)
    return (f"{_fire(series, t, spec.fire_share)} or ({_keep(series, t, spec.clear_share)} "
            f"and {on} {_firing(alert)})")


def expected_memory() -> str:
    used, total = _gauge("mem_used_gb_max"), "gpulens_gpu_memory_total_bytes"
    return _one("GpuMemoryNearlyFull", "memory_headroom", "headroom",
                f"(100 * (1 - {used} / {total})){RANGE[:-1]}:]")


def expected_power() -> str:
    spec = RULES["power_capped"]
    thr = _throttle("throttle_power_pct") + RANGE
    share = f"({_gauge('power_w')} / {_gauge('power_limit_w')}){RANGE[:-1]}:]"
    t1, t2 = spec.threshold("throttle_power"), spec.threshold("power_share")
    f, c = spec.fire_share, spec.clear_share
    return (f"({_fire(thr, t1, f)} and {GPU_ON} {_fire(share, t2, f)}) or "
            f"({_keep(thr, t1, c)} and {GPU_ON} {_keep(share, t2, c)} and {GPU_ON} "
            f"{_firing('GpuPowerThrottling')})")


def expected_thermal() -> str:
    return _one("GpuThermalThrottling", "thermal", "throttle_thermal",
                _throttle("throttle_thermal_pct") + RANGE)


def expected_under_used() -> str:
    sm, util = _gauge("sm_active_pct"), _gauge("util_pct")
    gpm = _one("GpuUnderUsed", "under_used", "sm_active", sm + RANGE)
    nvml = _one("GpuUnderUsed", "under_used", "util", util + RANGE)
    return (f"({gpm} or (({nvml}) unless {GPU_ON} {sm})) and {GPU_ON} "
            f"max_over_time({util}[1h]) >= {ACTIVE_PCT:g} "
            f'unless on(host) ALERTS{{alertname="TrainingInputBound"}}')


def expected_input_bound() -> str:
    return _one("TrainingInputBound", "input_bound", "data_wait",
                scalar_series_name("perf/data_wait_pct")[0] + RANGE, "on(host, instance, job)")


EXPECTED: dict[str, tuple[str, Callable[[], str]]] = {
    "GpuMemoryNearlyFull": ("memory_headroom", expected_memory),
    "GpuPowerThrottling": ("power_capped", expected_power),
    "GpuThermalThrottling": ("thermal", expected_thermal),
    "GpuUnderUsed": ("under_used", expected_under_used),
    "TrainingInputBound": ("input_bound", expected_input_bound),
}


def test_every_mirrored_alert_is_the_rule_tables_thresholds_in_promql() -> None:
    alerts = _alerts()
    mirrored = {name: a for name, a in alerts.items()
                if "rule" in a.get("labels", {})}  # type: ignore[operator]
    assert set(mirrored) == set(EXPECTED)
    for name, alert in mirrored.items():
        rule, build = EXPECTED[name]
        labels = alert["labels"]
        assert isinstance(labels, dict)
        assert labels["rule"] == rule and labels["severity"] == RULES[rule].severity, name
        assert _norm(str(alert["expr"])) == _norm(build()), (
            f"{name} does not say what RULES[{rule!r}] says; expected:\n{build()}")


def test_changing_a_threshold_breaks_the_agreement(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    spec = RULES["thermal"]
    t = dataclasses.replace(spec.threshold("throttle_thermal"), fire=12.0)
    monkeypatch.setitem(RULES, "thermal", dataclasses.replace(spec, thresholds=(t,)))
    assert _norm(str(_alerts()["GpuThermalThrottling"]["expr"])) != _norm(expected_thermal())


# -- promtool and the engine, fed the same series ---------------------------------------------

@dataclass
class Mirror:
    alert: str
    rule: str
    threshold: str
    series: Callable[[float], dict[str, float]]
    """primary value -> Prometheus series (selector with labels) -> value"""
    row: Callable[[float], dict[str, float]]
    """primary value -> row values for the engine"""
    labels: str
    """the alert's labels besides alertname, alertstate, severity and rule"""


TOTAL_GB = 80.0
GPU = GPU_LABELS = 'gpu="0",host="n1",instance="n1:9400",job="gpulens"'

MIRRORS = [
    Mirror("GpuMemoryNearlyFull", "memory_headroom", "headroom",
           lambda x: {f"gpulens_gpu_memory_used_max_bytes{{{GPU}}}":
                      TOTAL_GB * (1 - x / 100) * 1e9,
                      f"gpulens_gpu_memory_total_bytes{{{GPU}}}": TOTAL_GB * 1e9},
           lambda x: {"gpu/0/mem_used_gb_max": TOTAL_GB * (1 - x / 100)}, GPU_LABELS),
    Mirror("GpuPowerThrottling", "power_capped", "throttle_power",
           lambda x: {f'gpulens_gpu_clocks_throttled_percent{{{GPU},reason="power"}}': x,
                      f"gpulens_gpu_power_watts{{{GPU}}}": 690.0,
                      f"gpulens_gpu_power_limit_watts{{{GPU}}}": 700.0},
           lambda x: {"gpu/0/throttle_power_pct": x, "gpu/0/power_w": 690.0,
                      "gpu/0/power_limit_w": 700.0}, GPU_LABELS + ',reason="power"'),
    Mirror("GpuThermalThrottling", "thermal", "throttle_thermal",
           lambda x: {f'gpulens_gpu_clocks_throttled_percent{{{GPU},reason="thermal"}}': x},
           lambda x: {"gpu/0/throttle_thermal_pct": x}, GPU_LABELS + ',reason="thermal"'),
    Mirror("GpuUnderUsed", "under_used", "sm_active",
           lambda x: {f"gpulens_gpu_sm_active_percent{{{GPU}}}": x,
                      f"gpulens_gpu_utilization_percent{{{GPU}}}": 97.0},
           lambda x: {"gpu/0/sm_active_pct": x, "gpu/0/util_pct": 97.0}, GPU_LABELS),
    Mirror("GpuUnderUsed", "under_used", "util",
           lambda x: {f"gpulens_gpu_utilization_percent{{{GPU}}}": x},
           lambda x: {"gpu/0/util_pct": x}, GPU_LABELS),
    Mirror("TrainingInputBound", "input_bound", "data_wait",
           lambda x: {'gpulens_perf_data_wait_percent{host="n1",instance="n1:9401",'
                      'job="gpulens"}': x},
           lambda x: {"perf/data_wait_pct": x}, 'host="n1",instance="n1:9401",job="gpulens"'),
]

SEGMENT = 40  # samples (rows) per segment, 15 s apart: 10 minutes
INTERVAL_S = 15


def stories(t: Threshold) -> dict[str, tuple[list[float], list[bool]]]:
    """Sequences of the primary value, segment by segment, and the state each segment should
    end in."""
    gap, sign = abs(t.fire - t.clear), (1.0 if t.op == ">=" else -1.0)
    healthy, past_fire = t.clear - sign * gap, t.fire + sign * 0.1 * gap
    between, past_clear = (t.fire + t.clear) / 2, t.clear - sign * 0.1 * gap
    short_of_fire = t.fire - sign * 0.1 * gap
    return {
        "fires_holds_clears": ([healthy, past_fire, between, past_clear],
                               [False, True, True, False]),
        "never_past_fire": ([healthy, between, short_of_fire, between], [False] * 4),
    }


@pytest.mark.parametrize("mirror", MIRRORS, ids=lambda m: f"{m.alert}-{m.threshold}")
def test_promtool_and_the_engine_fire_and_clear_together(mirror: Mirror, tmp_path: Path) -> None:
    exe = binary("promtool")
    spec = RULES[mirror.rule]
    t = spec.threshold(mirror.threshold)
    gpus = (GpuInfo(0, "gpu", "uuid-0", "pci-0", mem_total_gb=TOTAL_GB, power_limit_w=700.0),)
    tests = []
    for story, (segments, want) in stories(t).items():
        values = [x for x in segments for _ in range(SEGMENT)]
        engine = RuleEngine(RulesConfig(gpus=gpus))
        got: list[bool] = []
        for n, x in enumerate(values):
            engine.feed(mirror.row(x), n + 1, 1.8e9 + n * INTERVAL_S)
            if n % SEGMENT == SEGMENT - 1:
                got.append(engine.alert_keys()[f"alerts/{mirror.rule}"] == 1.0)
        assert got == want, (story, got)  # the story tells what it should

        series: dict[str, list[float]] = {}
        for x in values:
            for sel, v in mirror.series(x).items():
                series.setdefault(sel, []).append(v)
        checks = []
        for k, firing in enumerate(got):
            at = ((k + 1) * SEGMENT - 1) * INTERVAL_S
            labels = (f'ALERTS{{alertname="{mirror.alert}",alertstate="firing",'
                      f'{mirror.labels},rule="{mirror.rule}",severity="{spec.severity}"}}')
            checks.append({
                "expr": f'ALERTS{{alertname="{mirror.alert}",alertstate="firing"}}',
                "eval_time": f"{at}s",
                "exp_samples": [{"labels": labels, "value": 1}] if firing else [],
            })
        tests.append({
            "interval": f"{INTERVAL_S}s",
            "input_series": [{"series": sel, "values": " ".join(f"{v:g}" for v in vs)}
                             for sel, vs in series.items()],
            "promql_expr_test": checks,
        })
    (tmp_path / "gpulens-rules.yml").write_text(RULES_YML.read_text())
    (tmp_path / "agree.test.yml").write_text(yaml.safe_dump({
        "rule_files": ["gpulens-rules.yml"], "evaluation_interval": f"{INTERVAL_S}s",
        "tests": tests}))
    proc = subprocess.run([exe, "test", "rules", "agree.test.yml"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
