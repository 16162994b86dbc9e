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
                 "_total", "_info", "_step", "_loss", "_rate", "_norm", "_gpus")


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
    """A plain training loop in a thread, with a prometheus sink on a free port."""

    def __init__(self) -> None:
        self.sink = PrometheusSink(port=0)
        self.monitor = gpulens.Monitor(backend="simulated", interval=0.05, sinks=[self.sink])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        step = 0
        while not self._stop.wait(0.1):
            step += 1
            self.monitor.log(step, loss=2.0 * math.exp(-step / 50) + 0.1,
                             learning_rate=3e-4, grad_norm=1.0 + (step % 5) / 10)

    def __enter__(self) -> Trainer:
        self.monitor.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.monitor.stop()


def test_sink_exposition_names_labels_and_own_registry() -> None:
    from prometheus_client import REGISTRY

    with Trainer() as t:
        deadline = time.time() + 20
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
        assert set(labels) == {"gpu", "uuid", "name", "host"}
        assert labels["uuid"].startswith("GPU-") and labels["name"].startswith("Simulated")
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


def test_sink_spec_and_port_in_use() -> None:
    assert PrometheusSink.from_spec(None).port == 9400
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
    deadline = time.time() + 20
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
    return (expr.replace("$host", ".*").replace("$gpu", ".*")
            .replace("$__rate_interval", "15s").replace("$__range", "1m"))


def test_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in dash["panels"]}
    assert {"GPU activity", "GPU memory used", "GPU power", "GPU temperature", "Loss",
            "Learning rate", "Gradient norm", "Step time"} <= titles
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert p["fieldConfig"]["defaults"]["unit"]
    assert {v["name"] for v in dash["templating"]["list"]} == {"DS_PROMETHEUS", "host", "gpu"}


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
            # the alert rules loaded and evaluate
            groups = json.loads(get(f"{api}/rules"))["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            assert len(rules) == rule_count()
            deadline = time.time() + 20
            while time.time() < deadline and any(r.get("health") != "ok" for r in rules):
                time.sleep(0.5)
                groups = json.loads(get(f"{api}/rules"))["data"]["groups"]
                rules = [r for g in groups for r in g["rules"]]
            assert all(r["health"] == "ok" for r in rules), rules
            # a live training is not "stalled"
            assert not query("time() - gpulens_train_last_step_timestamp_seconds > 600")
        finally:
            prom.terminate()
            prom.wait(timeout=30)
            log.close()


def test_promtool_accepts_the_rules_and_their_unit_tests() -> None:
    exe = binary("promtool")
    proc = subprocess.run([exe, "check", "rules", str(RULES)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {rule_count()} rules found" in proc.stdout
    proc = subprocess.run([exe, "test", "rules", "gpulens-rules.test.yml"], capture_output=True,
                          text=True, timeout=60, cwd=RULES.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run([exe, "check", "config", "prometheus.yml"], capture_output=True,
                          text=True, timeout=60, cwd=RULES.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
