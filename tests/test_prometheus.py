"""Prometheus exporter: the sink's exposition, ``gpulens serve``, a REAL Prometheus server from
Debian scraping both, every query of the Grafana dashboard answered through its HTTP API, and
promtool checking (and unit-testing) the alert rules."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gpulens
from gpulens.sinks.prometheus import PrometheusSink

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "integrations" / "prometheus" / "gpulens-rules.yml"
DASHBOARD = ROOT / "integrations" / "grafana" / "gpulens-dashboard.json"
NAME_RULE = re.compile(r"^gpulens_[a-z0-9_]+$")
UNIT_SUFFIXES = ("_percent", "_bytes", "_watts", "_celsius", "_hertz", "_seconds", "_joules",
                 "_total", "_info", "_step", "_loss", "_rate", "_norm", "_gpus", "_per_second",
                 "_per_joule", "gpulens_alert")
"""A unit last (rates as ``_per_second`` / ``_per_joule``, as OpenTelemetry's units become in
Prometheus); ``gpulens_alert`` is a state (1 firing, 0 not) with no unit, like ``ALERTS``."""
T0 = 1_700_000_000.0
DISTRIBUTED_ONLY = ("gpulens_train_cpu_busy_seconds", "gpulens_job_", "gpulens_rank_")
"""Series only a distributed job's endpoints serve."""


def binary(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is missing in CI (apt-get install -y prometheus)")
        pytest.skip(f"{name} is not installed (apt-get install -y prometheus)")
    return exe


def rule_count() -> int:
    import yaml

    return sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


class Trainer:
    """A plain training loop in a thread, with a prometheus sink on a free port; it reports
    its work (tokens, samples) and the run's dtype and FLOPs per token, so its rows carry
    throughput and MFU."""

    def __init__(self) -> None:
        self.sink = PrometheusSink(port=0)
        self.monitor = gpulens.Monitor(backend="simulated", interval=0.05, sinks=[self.sink],
                                       dtype="bf16", flops_per_token=7.44e8)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        step = 0
        while not self._stop.wait(0.1):
            step += 1
            self.monitor.log(step, loss=2.0 * math.exp(-step / 50) + 0.1,
                             learning_rate=3e-4, grad_norm=1.0 + (step % 5) / 10,
                             tokens=8192, samples=8)

    def __enter__(self) -> Trainer:
        self.monitor.start()
        deadline = time.monotonic() + 30  # the sink opens off start()'s thread: port 0 until
        while self.sink.port == 0 and time.monotonic() < deadline:  # its server is bound
            time.sleep(0.01)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.monitor.stop()


def test_sink_exposition_names_labels_and_own_registry() -> None:
    from prometheus_client import REGISTRY

    with Trainer() as t:
        deadline = time.time() + 90  # bounds a hang
        while time.time() < deadline:
            metrics = parse(get(t.sink.url))
            if "gpulens_train_loss" in metrics and "gpulens_gpu_energy_joules_total" in metrics:
                break
            time.sleep(0.2)
        assert t.sink.host == "127.0.0.1" and t.sink.port > 0
    for name in metrics:
        assert NAME_RULE.match(name), name
        assert name.endswith(UNIT_SUFFIXES) or name in ("gpulens_train_learning_rate",), name
    util = metrics["gpulens_gpu_utilization_percent"]
    assert sorted(lbl["gpu"] for lbl, _ in util) == ["0", "1"]
    for labels, value in util:
        assert set(labels) == {"gpu", "uuid", "name", "host", "node", "rank"}
        assert labels["uuid"].startswith("GPU-") and labels["name"].startswith("Simulated")
        assert labels["node"] == labels["rank"] == ""  # one process: no node, no rank
        assert 0 <= value <= 100
    used = dict((lbl["gpu"], v) for lbl, v in metrics["gpulens_gpu_memory_used_bytes"])
    total = dict((lbl["gpu"], v) for lbl, v in metrics["gpulens_gpu_memory_total_bytes"])
    assert 1e9 < used["0"] < total["0"] < 1e12  # bytes, not GB
    assert {lbl["reason"] for lbl, _ in metrics["gpulens_gpu_clocks_throttled_percent"]} == {
        "any", "power", "thermal"}
    assert all(v > 0 for _, v in metrics["gpulens_gpu_energy_joules_total"])
    assert 1e8 < metrics["gpulens_gpu_sm_clock_hertz"][0][1] < 1e10
    (_, step), = metrics["gpulens_train_step"]
    (_, last), = metrics["gpulens_train_last_step_timestamp_seconds"]
    assert step >= 1 and abs(last - time.time()) < 30
    assert 0 < metrics["gpulens_train_step_time_seconds"][0][1] < 5
    # nothing went to the process-wide registry
    assert not [m for m in REGISTRY.collect() if m.name.startswith("gpulens")]
    # the port is released on stop
    with pytest.raises(OSError):
        get(t.sink.url, timeout=2)


def exposed(sink: PrometheusSink) -> dict[str, list[tuple[dict[str, str], float]]]:
    body, _ = sink.exposition()
    return parse(body.decode())


PERF_ROW = {
    "train/global_step": 7.0, "train/loss": 2.5, "perf/steps": 1.0, "perf/step_time_s": 0.5,
    "perf/data_wait_pct": 3.0, "perf/tokens_per_s": 16384.0, "perf/samples_per_s": 8.0,
    "perf/tokens_per_j": 23.4, "perf/samples_per_j": 0.0114, "perf/tflops": 312.5,
    "perf/tflops_job": 625.0, "perf/mfu_pct": 31.6, "perf/mfu_clock_adjusted_pct": 33.2,
    "perf/mfu_when_tensor_active_pct": 45.0, "rank/0/cpu_busy_s": 0.21,
    "rank/1/cpu_busy_s": 0.34, "alerts/input_bound": 1.0, "alerts/thermal": 0.0,
    "gpu/0/util_pct": 90.0,
}


def test_throughput_mfu_alerts_and_ranks_with_proper_names_and_labels() -> None:
    from gpulens.model import GpuInfo, Row, RunContext

    sink = PrometheusSink(port=0, http=False)
    sink.open(RunContext(gpus=(GpuInfo(0, "NVIDIA H100 80GB HBM3", "GPU-0", "0:1"),),
                         hostname="n1", backend="nvml", interval=0.5,
                         meta={"dtype": "bf16", "peak_gpu": "H100 SXM5 80GB",
                               "peak_dtype": "bf16", "peak_tflops": 989.4}))
    sink.write(Row(step=7, time=T0, values=dict(PERF_ROW)))
    m = exposed(sink)

    def one(name: str) -> float:
        (labels, value), = m[name]
        assert labels == {"host": "n1"}, (name, labels)
        return value

    assert one("gpulens_train_tokens_per_second") == 16384.0
    assert one("gpulens_train_samples_per_second") == 8.0
    assert one("gpulens_train_tokens_per_joule") == 23.4
    assert one("gpulens_train_samples_per_joule") == 0.0114
    assert one("gpulens_train_model_flops_per_gpu_per_second") == pytest.approx(312.5e12)
    assert one("gpulens_train_model_flops_per_second") == pytest.approx(625e12)
    assert one("gpulens_train_mfu_percent") == 31.6
    assert one("gpulens_train_mfu_clock_adjusted_percent") == 33.2
    assert one("gpulens_train_mfu_when_tensor_active_percent") == 45.0
    assert one("gpulens_perf_data_wait_percent") == 3.0  # the alert rules' input: unchanged
    (labels, peak), = m["gpulens_train_mfu_peak_flops_per_second"]
    assert labels == {"host": "n1", "peak_gpu": "H100 SXM5 80GB", "dtype": "bf16"}
    assert peak == pytest.approx(989.4e12)
    assert {lbl["rule"]: v for lbl, v in m["gpulens_alert"]} == {"input_bound": 1.0,
                                                                 "thermal": 0.0}
    assert {lbl["rank"]: v for lbl, v in m["gpulens_train_cpu_busy_seconds"]} == {
        "0": 0.21, "1": 0.34}
    for name in m:  # no path parts or TFLOP left in a name
        assert NAME_RULE.match(name) and "tflops" not in name and "perf_tokens" not in name
        assert name.endswith(UNIT_SUFFIXES), name
    # the next row lacks MFU, an alert and the ranks: gone, never carried forward
    later = {k: v for k, v in PERF_ROW.items()
             if not k.startswith(("perf/mfu", "rank/", "alerts/thermal"))}
    sink.write(Row(step=8, time=T0 + 1, values=later))
    m = exposed(sink)
    assert not [n for n in m if "mfu_percent" in n or "mfu_clock" in n]
    assert [lbl["rule"] for lbl, _ in m["gpulens_alert"]] == ["input_bound"]
    assert "gpulens_train_cpu_busy_seconds" not in m
    assert one("gpulens_train_loss") == 2.5
    sink.close()
    # `gpulens serve` (training=False): its rows are intervals, not training steps
    serve = PrometheusSink(port=0, training=False, http=False)
    serve.open(RunContext(gpus=(), hostname="n1", backend="nvml", interval=1.0,
                          meta={"peak_tflops": 989.4}))
    serve.write(Row(step=3, time=T0, values=dict(PERF_ROW)))
    assert sorted(exposed(serve)) == ["gpulens_gpu_info", "gpulens_gpu_utilization_percent"]
    serve.close()


def _serve_default_port() -> int:
    from gpulens.cli import build_parser

    return int(build_parser().parse_args(["serve"]).port)


def test_sink_spec_and_port_in_use() -> None:
    # the training's default is not `gpulens serve`'s (9400): a node runs both; the shipped
    # scrape config scrapes the training's at 9401
    assert PrometheusSink.from_spec(None).port == 9401
    config = (RULES.parent / "prometheus.yml").read_text()
    assert ":9401   # the training process's sink" in config
    assert _serve_default_port() == 9400
    s = PrometheusSink.from_spec("0.0.0.0:9500")
    assert (s.host, s.port) == ("0.0.0.0", 9500)
    with pytest.raises(ValueError, match="expected 'prometheus:PORT'"):
        PrometheusSink.from_spec("abc")
    with pytest.raises(ValueError, match="0-65535"):
        PrometheusSink.from_spec("99999")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        mon = gpulens.Monitor(backend="simulated", sinks=[f"prometheus:{port}"])
        with pytest.raises(ValueError, match=f"cannot serve on 127.0.0.1:{port}: port in use"):
            mon.start()
        mon.stop()
    # `gpulens serve` on a port in use: tests/test_dashboard_server.py


def exported_names() -> set[str]:
    """Every series name the sink exports, from a row that holds every key the engine and a
    training loop give (and a context with MFU's peak)."""
    from gpulens.model import GpuInfo, Row, RunContext
    from gpulens.sinks.prometheus import GPU_SERIES, THROTTLE_SERIES

    sink = PrometheusSink(port=0, http=False)
    sink.open(RunContext(gpus=(GpuInfo(0, "NVIDIA H100 80GB HBM3", "GPU-0", "0:1", 85.9, 700.0),),
                         hostname="n1", backend="nvml", interval=0.5, meta={"peak_tflops": 989.4}))
    values = {**PERF_ROW, "perf/energy_per_step_j": 5.0,
              "train/learning_rate": 1e-4, "train/grad_norm": 1.0, "host/cpu_pct": 5.0,
              "host/ram_used_gb": 3.0, "gpu/0/energy_j": 10.0}
    values.update({f"gpu/0/{k}": 1.0 for k in (*GPU_SERIES, *THROTTLE_SERIES)})
    # a distributed job's rank 0 (gpulens.sinks.prometheus_job)
    values.update({"job/ranks": 2.0, "job/nodes": 2.0, "job/world": 2.0, "job/partial": 0.0,
                   "node/1/ranks": 1.0, "node/1/partial": 0.0, "rank/1/gpu_busy_s": 0.2,
                   "rank/1/gpu_relative_score": 0.9, "rank/1/gpu_individual_score": 1.0})
    sink.write(Row(step=7, time=T0, values=values))
    names = set(exposed(sink))
    sink.close()
    return names


def test_every_dashboard_and_alert_expression_names_exported_series() -> None:
    import yaml

    names = exported_names() | {"ALERTS", "up"}
    exprs = dashboard_queries()
    exprs += [str(r["expr"]) for g in yaml.safe_load(RULES.read_text())["groups"]
              for r in g["rules"]]
    dash = json.loads(DASHBOARD.read_text())
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            exprs.append(v["definition"])
    missing = {(name, e) for e in exprs
               for name in re.findall(r"\b(gpulens_[a-z0-9_]+|ALERTS|up)\b\s*(?:\{|\[|\)|$|\s)",
                                      e + " ")
               if name not in names}
    assert not missing, sorted(missing)
    # every series the engine adds for throughput, MFU and alerts is on the dashboard
    shown = {n for e in dashboard_queries() for n in re.findall(r"gpulens_[a-z0-9_]+", e)}
    engine = {n for n in names if n.startswith(("gpulens_train_tokens", "gpulens_train_samples",
                                                "gpulens_train_model_flops",
                                                "gpulens_train_mfu", "gpulens_alert",
                                                "gpulens_train_cpu_busy"))}
    assert len(engine) == 12 and engine <= shown, sorted(engine - shown)


@pytest.fixture
def served() -> Iterator[str]:
    """``gpulens serve --port 0`` in a subprocess; yields its metrics URL."""
    proc = subprocess.Popen([sys.executable, "-m", "gpulens.cli", "serve", "--port", "0",
                             "--interval", "0.25"], stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, GPULENS_BACKEND="simulated",
                                     GPULENS_SIMULATED_GPUS="2"))
    assert proc.stderr is not None
    line = proc.stderr.readline()
    m = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", line)
    assert m, line
    try:
        yield m.group(1)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err  # SIGTERM is a clean stop


def test_serve_has_gpu_metrics_but_no_training_metrics(served: str) -> None:
    deadline = time.time() + 90  # bounds a hang
    metrics: dict[str, Any] = {}
    while time.time() < deadline and "gpulens_gpu_power_watts" not in metrics:
        metrics = parse(get(served))
        time.sleep(0.2)
    assert len(metrics["gpulens_gpu_power_watts"]) == 2
    assert "gpulens_host_cpu_percent" in metrics
    assert not [n for n in metrics if n.startswith("gpulens_train")]


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    return exprs


def instantiate(expr: str) -> str:
    """Grafana's variables as Grafana would fill them with 'All' selected."""
    return (expr.replace("$host", ".*").replace("$gpu", ".*").replace("$node", ".*")
            .replace("$__rate_interval", "15s").replace("$__range", "1m"))


def test_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in dash["panels"]}
    assert {"GPU activity", "GPU memory used", "GPU power", "GPU temperature", "Loss",
            "Learning rate", "Gradient norm", "Step time", "Throughput",
            "MFU beside tensor-core activity", "Achieved model FLOP/s per GPU",
            "Work per joule", "Advice rules firing", "Advice rules over time"} <= titles
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert p["fieldConfig"]["defaults"]["unit"]
    assert {v["name"] for v in dash["templating"]["list"]} == {"DS_PROMETHEUS", "host", "node",
                                                               "gpu"}


def test_real_prometheus_scrapes_and_answers_every_dashboard_query(
    tmp_path: Path, served: str
) -> None:
    exe = binary("prometheus")
    served_target = served.removeprefix("http://").removesuffix("/metrics")
    with Trainer() as trainer:
        train_target = f"127.0.0.1:{trainer.sink.port}"
        shutil.copy(RULES, tmp_path / "gpulens-rules.yml")
        (tmp_path / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "rule_files: [gpulens-rules.yml]\n"
            "scrape_configs:\n  - job_name: gpulens\n    static_configs:\n"
            f"      - targets: ['{served_target}', '{train_target}']\n"
        )
        port = free_port()
        api = f"http://127.0.0.1:{port}/api/v1"
        log = (tmp_path / "prometheus.log").open("w")
        prom = subprocess.Popen(
            [exe, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
        )
        try:
            def query(expr: str) -> list[Any]:
                url = f"{api}/query?" + urllib.parse.urlencode({"query": expr})
                body = json.loads(get(url))
                assert body["status"] == "success", body
                return list(body["data"]["result"])

            # wait until both targets are up and scraped a few times
            deadline = time.time() + 90
            up: list[Any] = []
            while time.time() < deadline:
                try:
                    up = query('up{job="gpulens"} == 1')
                    if len(up) == 2 and query('count_over_time(gpulens_gpu_info[1m]) >= 4'):
                        break
                except OSError:
                    pass  # still starting
                time.sleep(0.5)
            assert len(up) == 2, (tmp_path / "prometheus.log").read_text()[-3000:]

            empty = []
            for expr in dashboard_queries():
                if any(name in expr for name in DISTRIBUTED_ONLY):
                    # distributed jobs only (rank/{r}/cpu_busy_s, the slow-rank rule's input;
                    # the job's and ranks' figures): this loop is one process (the exposition:
                    # test_throughput_mfu_alerts_..., tests/test_integration_distributed.py)
                    continue
                result: list[Any] = []
                for _ in range(20):
                    result = query(instantiate(expr))
                    if result:
                        break
                    time.sleep(0.5)
                if not result:
                    empty.append(expr)
                else:
                    assert all(math.isfinite(float(r["value"][1])) for r in result), expr
            assert not empty, f"dashboard queries without data: {empty}"

            # the template variables' label_values() queries
            for label in ("host", "gpu"):
                url = f"{api}/label/{label}/values?" + urllib.parse.urlencode(
                    {"match[]": "gpulens_gpu_info"})
                values = json.loads(get(url))["data"]
                assert values == ([socket.gethostname()] if label == "host" else ["0", "1"])
            # both exporters' GPUs, labelled apart by instance
            assert len(query("gpulens_gpu_utilization_percent")) == 4
            assert len(query("gpulens_train_loss")) == 1
            # throughput and MFU from the training's exporter only; alerts one per rule
            (mfu,) = query("gpulens_train_mfu_percent")
            assert 0 < float(mfu["value"][1]) < 100
            (peak,) = query("gpulens_train_mfu_peak_flops_per_second")
            assert peak["metric"]["peak_gpu"] == "H100 SXM5 80GB"
            assert peak["metric"]["dtype"] == "bf16"
            assert {r["metric"]["rule"] for r in query("gpulens_alert")} >= {"thermal"}
            # the alert rules loaded and evaluate
            groups = json.loads(get(f"{api}/rules"))["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            assert len(rules) == rule_count()
            deadline = time.time() + 90  # bounds a hang
            while time.time() < deadline and any(r.get("health") != "ok" for r in rules):
                time.sleep(0.5)
                groups = json.loads(get(f"{api}/rules"))["data"]["groups"]
                rules = [r for g in groups for r in g["rules"]]
            assert all(r["health"] == "ok" for r in rules), rules
            # a live training is not "stalled"
            assert not query("time() - gpulens_train_last_step_timestamp_seconds > 600")
        finally:
            prom.terminate()
            prom.wait(timeout=120)
            log.close()


def test_promtool_accepts_the_rules_and_their_unit_tests() -> None:
    exe = binary("promtool")
    proc = subprocess.run([exe, "check", "rules", str(RULES)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {rule_count()} rules found" in proc.stdout
    proc = subprocess.run([exe, "test", "rules", "gpulens-rules.test.yml"], capture_output=True,
                          text=True, timeout=240, cwd=RULES.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run([exe, "check", "config", "prometheus.yml"], capture_output=True,
                          text=True, timeout=240, cwd=RULES.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_gpu_the_row_no_longer_carries_is_gone_not_carried_forward() -> None:
    """A GPU lost mid-run: its gauges leave the next scrape (DESIGN's failure model: a metric
    that stops reading is absent from then on), while the GPU still there keeps its own."""
    from gpulens.model import Row

    sink = PrometheusSink(port=0, http=False)
    sink.open(None)  # type: ignore[arg-type]
    both = {"gpu/0/power_w": 300.0, "gpu/0/energy_j": 30.0,
            "gpu/1/power_w": 582.5, "gpu/1/energy_j": 58.0}
    sink.write(Row(step=1, time=T0, values=both))
    assert {lbl["gpu"] for lbl, _ in exposed(sink)["gpulens_gpu_power_watts"]} == {"0", "1"}
    sink.write(Row(step=2, time=T0 + 1, values={"gpu/0/power_w": 310.0,
                                                 "gpu/0/energy_j": 31.0}))
    power = exposed(sink)["gpulens_gpu_power_watts"]
    assert [(lbl["gpu"], v) for lbl, v in power] == [("0", 310.0)]
    energy = dict((lbl["gpu"], v) for lbl, v in exposed(sink)["gpulens_gpu_energy_joules_total"])
    assert energy == {"0": 61.0, "1": 58.0}  # a counter stays: what was used was used


def test_a_sink_opened_again_serves_nothing_of_the_previous_run() -> None:
    """One sink object for two runs (a monitor started again, an HPO loop passing the same
    sink): the second run's endpoint has neither the first run's training series nor its GPUs
    and energy; the energy counter counts from the second open, as the module says."""
    from gpulens.model import GpuInfo, Row, RunContext

    def context(gpus: int) -> RunContext:
        return RunContext(gpus=tuple(GpuInfo(i, "NVIDIA H100 80GB HBM3", f"GPU-{i}", f"0:{i}")
                                     for i in range(gpus)),
                          hostname="n1", backend="nvml", interval=0.5)

    sink = PrometheusSink(port=0, http=False)
    sink.open(context(2))
    sink.write(Row(step=30, time=T0, values={
        "train/global_step": 30.0, "train/loss": 5.0, "train/learning_rate": 0.1,
        "perf/steps": 30.0, "gpu/0/energy_j": 100.0, "gpu/1/energy_j": 100.0}))
    sink.close()
    sink.open(context(1))  # the next run: one GPU, nothing logged yet
    m = exposed(sink)
    assert not [n for n in m if n.startswith("gpulens_train")], sorted(m)
    assert "gpulens_gpu_energy_joules_total" not in m
    assert [lbl["gpu"] for lbl, _ in m["gpulens_gpu_info"]] == ["0"]
    sink.write(Row(step=1, time=T0 + 60, values={"train/loss": 1.0, "perf/steps": 1.0,
                                                  "gpu/0/energy_j": 7.0}))
    m = exposed(sink)
    assert [v for _, v in m["gpulens_gpu_energy_joules_total"]] == [7.0]
    assert [v for _, v in m["gpulens_train_steps_total"]] == [1.0]
    assert [v for _, v in m["gpulens_train_step"]] == [1.0]
    assert "gpulens_train_learning_rate" not in m
    sink.close()


def test_dashboard_energy_counts_each_gpu_once_with_serve_and_training(tmp_path: Path) -> None:
    """integrations/prometheus/prometheus.yml scrapes `gpulens serve` (9400) and the training's
    sink (9401) on one node: both count the same GPUs' energy, told apart only by `instance`.
    The "GPU energy in the selected range" stat must count each GPU once (promtool evaluates
    the panel's expression; 360 J a minute per GPU, 2 GPUs, 10 minutes: 2 Wh)."""
    exe = binary("promtool")
    dash = json.loads(DASHBOARD.read_text())
    (expr,) = [t["expr"] for p in dash["panels"] if p["title"] == "GPU energy in the selected range"
               for t in p["targets"]]
    (tmp_path / "rules.yml").write_text(json.dumps({"groups": [{"name": "panel", "rules": [
        {"record": "panel_energy_wh", "expr": instantiate(expr).replace("[1m]", "[10m]")}]}]}))
    series = [{"series": f'gpulens_gpu_energy_joules_total{{gpu="{i}",uuid="GPU-{i}",host="n1",'
                         f'instance="n1:{port}",job="gpulens"}}', "values": "0+360x20"}
              for i in (0, 1) for port in (9400, 9401)]
    (tmp_path / "test.yml").write_text(json.dumps({
        "rule_files": ["rules.yml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": [
            {"expr": "panel_energy_wh", "eval_time": "10m",
             "exp_samples": [{"labels": 'panel_energy_wh{host="n1"}', "value": 2}]}]}]}))
    proc = subprocess.run([exe, "test", "rules", "test.yml"], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_exporter_down_alert_leaves_out_the_training_sink() -> None:
    """The training's sink (9401 in the scrape config) serves only while a training runs: a
    job that ended is not an exporter down. GpulensExporterDown's job scrapes `gpulens serve`
    alone, and the training's sink is still scraped, in a job of its own."""
    import yaml

    config = yaml.safe_load((RULES.parent / "prometheus.yml").read_text())
    targets = {j["job_name"]: [t for c in j["static_configs"] for t in c["targets"]]
               for j in config["scrape_configs"]}
    (expr,) = [str(r["expr"]) for g in yaml.safe_load(RULES.read_text())["groups"]
               for r in g["rules"] if r.get("alert") == "GpulensExporterDown"]
    m = re.search(r'up\{job="([^"]+)"\}', expr)
    assert m is not None, expr
    assert targets[m.group(1)] and not [t for t in targets[m.group(1)] if t.endswith(":9401")]
    assert [t for ts in targets.values() for t in ts if t.endswith(":9401")]
