"""Prometheus exporter sink: ``sinks=["prometheus"]`` serves the latest row on
``http://127.0.0.1:9401/metrics`` (:data:`DEFAULT_PORT`; ``"prometheus:PORT"`` for another).

The sink keeps its own :class:`prometheus_client.CollectorRegistry` (never the global one), so
several monitors, tests, or an application's own metrics do not collide.  It binds 127.0.0.1
unless told otherwise (``"prometheus:0.0.0.0:9401"``); port 0 picks a free port, readable as
``sink.port`` after ``open()``.

Exposed series (labels ``gpu``, ``uuid``, ``name``, ``host``, ``node``, ``rank`` on every GPU
series; ``host`` on the others).  In a distributed job each node's leader serves its node's GPUs
(``node``: the node's index, ``rank``: the global rank that trains on the GPU, ``host``: the
node's name), rank 0 also the job's figures (:mod:`gpulens.sinks.prometheus_job`); outside one,
``node`` and ``rank`` are empty.  Gauges hold the mean over the latest row's window; the energy
counter is the sum of the windows' counter differences since the sink opened.

======================================================  ==========================================
``gpulens_gpu_info``                                    1, with ``pci_bus_id`` too
``gpulens_gpu_utilization_percent``                     NVML utilization
``gpulens_gpu_sm_active_percent``                       GPM SM active (Hopper+)
``gpulens_gpu_sm_occupancy_percent``                    GPM SM occupancy (Hopper+)
``gpulens_gpu_tensor_active_percent``                   GPM tensor pipes active (Hopper+)
``gpulens_gpu_dram_bandwidth_percent``                  GPM DRAM bandwidth (Hopper+)
``gpulens_gpu_memory_used_bytes`` / ``_max_bytes``      device memory used (mean / peak)
``gpulens_gpu_memory_total_bytes``                      device memory total
``gpulens_gpu_memory_used_percent``                     used share of total
``gpulens_gpu_power_watts`` / ``_max_watts``            board power (mean / peak)
``gpulens_gpu_power_limit_watts``                       enforced power limit
``gpulens_gpu_energy_joules_total``                      counter
``gpulens_gpu_temperature_celsius`` / ``_max_celsius``  core temperature (mean / peak)
``gpulens_gpu_sm_clock_hertz``                          SM clock
``gpulens_gpu_memory_clock_hertz``                      memory clock
``gpulens_gpu_nvlink_receive_bytes_per_second``,        NVLink data, all links (GPM, else NVML's
``..._transmit_bytes_per_second``                       counters): mean rate over the window
``gpulens_gpu_pcie_receive_bytes_per_second``,          PCIe traffic to / from the GPU
``..._transmit_bytes_per_second``
``gpulens_gpu_clocks_throttled_percent{reason}``        share of time clocks were held down;
                                                        ``reason`` = any, power, thermal
``gpulens_gpu_torch_allocated_bytes`` / ``_peak_bytes`` torch allocator (training process)
``gpulens_host_cpu_percent``, ``..._memory_used_bytes`` host
``gpulens_train_step``                                  ``train/global_step``
``gpulens_train_last_step_timestamp_seconds``           Unix time the step last advanced
``gpulens_train_steps_total``                           counter of steps seen (``perf/steps``)
``gpulens_train_step_time_seconds``                     ``perf/step_time_s``
``gpulens_train_tokens_per_second``                     ``perf/tokens_per_s`` (all GPUs)
``gpulens_train_samples_per_second``                    ``perf/samples_per_s`` (all GPUs)
``gpulens_train_tokens_per_joule``                      ``perf/tokens_per_j`` (GPU energy)
``gpulens_train_samples_per_joule``                     ``perf/samples_per_j``
``gpulens_train_model_flops_per_gpu_per_second``        ``perf/tflops`` x 1e12: achieved model
                                                        FLOP/s per GPU
``gpulens_train_model_flops_per_second``                ``perf/tflops_job`` x 1e12: all the GPUs
``gpulens_train_mfu_percent``                           ``perf/mfu_pct``
``gpulens_train_mfu_clock_adjusted_percent``            ``perf/mfu_clock_adjusted_pct``
``gpulens_train_mfu_when_tensor_active_percent``        ``perf/mfu_when_tensor_active_pct``
``gpulens_train_mfu_peak_flops_per_second``             MFU's denominator: one GPU's dense peak
                                                        in the run's dtype (FLOP/s), labels
                                                        ``peak_gpu``, ``dtype`` (the run's meta)
``gpulens_train_cpu_busy_seconds{rank}``                distributed jobs: CPU seconds per step
                                                        of each rank's training thread
                                                        (``rank/{r}/cpu_busy_s``)
``gpulens_alert{rule}``                                 ``alerts/<rule>``: 1 while the engine's
                                                        advice rule fires, 0 while it does not
``gpulens_train_loss``, ``..._learning_rate``, ...      every other ``train/*`` and ``perf/*``
                                                        scalar, units spelled out
======================================================  ==========================================

Names follow Prometheus's rules: base units (FLOP/s, not TFLOP/s; bytes, not GB), the unit
last (``_per_second``, ``_per_joule`` for rates, as OpenTelemetry's units become in
Prometheus), labels instead of path parts (``rank``, ``rule``).  The engine's figures
(``perf/*``, ``alerts/*``, ``rank/*``) are the latest row's: one that a row no longer carries
is gone from the next scrape, never its last value carried forward.  ``train/*`` scalars keep
their last logged value (a learning rate logged every 100 steps stays visible).

Training series (everything ``gpulens_train_*``, and ``gpulens_alert``, whose rules judge
training steps) are left out with ``training=False`` (``gpulens serve``, where the step counter
counts intervals, not training steps; ``integrations/prometheus/gpulens-rules.yml`` has the
node-level alerts).
"""

from __future__ import annotations

import errno
import math
import re
import threading
from collections.abc import Iterator
from typing import Any

from gpulens.model import GpuInfo, Row, RunContext
from gpulens.schema import GPU_METRIC_BY_KEY
from gpulens.sinks import check_port, host_port_options, port_taken
from gpulens.sinks.prometheus_job import job_families

DEFAULT_PORT = 9401
"""A training's endpoint, where ``integrations/prometheus/prometheus.yml`` scrapes it: one above
``gpulens serve``'s 9400, so a node that runs both (serve always, the sink while it trains)
binds each without a word (on one port the training's start failed: the port was taken)."""

_GPU_KEY = re.compile(r"^gpu/(\d+)/([a-z0-9_]+)$")
_GPU_LABELS = ("gpu", "uuid", "name", "host", "node", "rank")

# row suffix -> (metric name, scale to base unit)
GPU_SERIES: dict[str, tuple[str, float]] = {
    "util_pct": ("gpulens_gpu_utilization_percent", 1.0),
    "sm_active_pct": ("gpulens_gpu_sm_active_percent", 1.0),
    "sm_occupancy_pct": ("gpulens_gpu_sm_occupancy_percent", 1.0),
    "tensor_active_pct": ("gpulens_gpu_tensor_active_percent", 1.0),
    "dram_bw_pct": ("gpulens_gpu_dram_bandwidth_percent", 1.0),
    "mem_used_gb": ("gpulens_gpu_memory_used_bytes", 1e9),
    "mem_used_gb_max": ("gpulens_gpu_memory_used_max_bytes", 1e9),
    "mem_pct": ("gpulens_gpu_memory_used_percent", 1.0),
    "power_w": ("gpulens_gpu_power_watts", 1.0),
    "power_w_max": ("gpulens_gpu_power_max_watts", 1.0),
    "power_limit_w": ("gpulens_gpu_power_limit_watts", 1.0),
    "temp_c": ("gpulens_gpu_temperature_celsius", 1.0),
    "temp_c_max": ("gpulens_gpu_temperature_max_celsius", 1.0),
    "sm_clock_mhz": ("gpulens_gpu_sm_clock_hertz", 1e6),
    "mem_clock_mhz": ("gpulens_gpu_memory_clock_hertz", 1e6),
    "nvlink_rx_gb_per_s": ("gpulens_gpu_nvlink_receive_bytes_per_second", 1e9),
    "nvlink_tx_gb_per_s": ("gpulens_gpu_nvlink_transmit_bytes_per_second", 1e9),
    "pcie_rx_gb_per_s": ("gpulens_gpu_pcie_receive_bytes_per_second", 1e9),
    "pcie_tx_gb_per_s": ("gpulens_gpu_pcie_transmit_bytes_per_second", 1e9),
    "torch_allocated_gb": ("gpulens_gpu_torch_allocated_bytes", 1e9),
    "torch_peak_gb": ("gpulens_gpu_torch_peak_bytes", 1e9),
}
THROTTLE_SERIES = {"throttle_pct": "any", "throttle_power_pct": "power",
                   "throttle_thermal_pct": "thermal"}
_UNITS = (("_pct", "_percent", 1.0), ("_gb", "_bytes", 1e9), ("_mb", "_bytes", 1e6),
          ("_w", "_watts", 1.0), ("_j", "_joules", 1.0), ("_c", "_celsius", 1.0),
          ("_mhz", "_hertz", 1e6), ("_ms", "_seconds", 1e-3), ("_s", "_seconds", 1.0))


PERF_SERIES: dict[str, tuple[str, float, str]] = {
    "perf/tokens_per_s": ("gpulens_train_tokens_per_second", 1.0,
                          "tokens the job's GPUs processed per second in the latest window"),
    "perf/samples_per_s": ("gpulens_train_samples_per_second", 1.0,
                           "samples the job's GPUs processed per second in the latest window"),
    "perf/tokens_per_j": ("gpulens_train_tokens_per_joule", 1.0,
                          "tokens per joule of the GPUs' energy in the latest window"),
    "perf/samples_per_j": ("gpulens_train_samples_per_joule", 1.0,
                           "samples per joule of the GPUs' energy in the latest window"),
    "perf/tflops": ("gpulens_train_model_flops_per_gpu_per_second", 1e12,
                    "achieved model FLOP/s per GPU (job FLOPs / s / GPUs) in the latest window"),
    "perf/tflops_job": ("gpulens_train_model_flops_per_second", 1e12,
                        "achieved model FLOP/s of all the job's GPUs in the latest window"),
    "perf/mfu_pct": ("gpulens_train_mfu_percent", 1.0,
                     "model FLOPs utilization: achieved FLOP/s per GPU / the GPU's dense peak "
                     "in the run's dtype (gpulens_train_mfu_peak_flops_per_second)"),
    "perf/mfu_clock_adjusted_pct": ("gpulens_train_mfu_clock_adjusted_percent", 1.0,
                                    "MFU against the peak scaled by the mean SM clock over "
                                    "the boost clock"),
    "perf/mfu_when_tensor_active_pct": ("gpulens_train_mfu_when_tensor_active_percent", 1.0,
                                        "MFU / GPM tensor-pipe active share: the share of "
                                        "peak while the tensor cores were busy"),
}
"""The engine's throughput and MFU keys -> (metric name, scale to base unit, help)."""
CPU_BUSY = ("gpulens_train_cpu_busy_seconds",
            "CPU seconds each rank's training thread used per step in the latest window "
            "(distributed jobs)")
ALERT = "gpulens_alert"
PEAK = "gpulens_train_mfu_peak_flops_per_second"
_RANK_KEY = re.compile(r"^rank/(\d+)/cpu_busy_s$")
_ENGINE_PREFIXES = ("perf/", "alerts/", "rank/", "node/", "job/")


def scalar_series_name(key: str) -> tuple[str, float]:
    """``"train/loss"`` -> ``("gpulens_train_loss", 1.0)``; ``"perf/step_time_s"`` ->
    ``("gpulens_train_step_time_seconds", 1.0)``; ``"host/ram_used_gb"`` ->
    ``("gpulens_host_ram_used_bytes", 1e9)``: units spelled out, scaled to base units."""
    if key in PERF_SERIES:
        name, scale, _ = PERF_SERIES[key]
        return name, scale
    if key == "perf/step_time_s":
        return "gpulens_train_step_time_seconds", 1.0
    if key == "perf/energy_per_step_j":
        return "gpulens_train_energy_per_step_joules", 1.0
    if key == "host/ram_used_gb":
        return "gpulens_host_memory_used_bytes", 1e9
    if key == "perf/partial_gpus":  # a count of GPUs: the unit is the GPU
        return "gpulens_partial_window_gpus", 1.0
    name = re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_").lower()
    scale = 1.0
    for suffix, unit, factor in _UNITS:
        if name.endswith(suffix):
            name, scale = name[: -len(suffix)] + unit, factor
            break
    name = re.sub(r"_+", "_", name)
    return f"gpulens_{name}", scale


def _cannot_serve(host: str, port: int, exc: OSError) -> str:
    reason = "port in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return f"prometheus sink: cannot serve on {host}:{port}: {reason}"


class PrometheusSink:
    """Serve the latest row as Prometheus metrics (see the module docstring for the names).

    Args:
        port: TCP port; 0 picks a free one (``self.port`` tells which after ``open()``).
        host: address to bind; 127.0.0.1 unless you mean to expose it.
        training: also export ``train/*`` and ``perf/*`` scalars (the training process's view).
        http: serve ``/metrics`` on ``host:port`` from ``open()``.  ``False``: no server of
            its own; another server (``gpulens serve``'s dashboard) serves :meth:`exposition`.
    """

    on_training_thread = False

    def __init__(self, port: int = DEFAULT_PORT, host: str = "127.0.0.1",
                 training: bool = True, *, http: bool = True) -> None:
        check_port("prometheus", port)
        self.port = port
        self.host = host
        self.training = training
        self.http = http
        self._registry: Any = None
        self._lock = threading.Lock()
        self._context: RunContext | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._clear()

    def _clear(self) -> None:
        """Forget every run's figures (at construction, and at each open: a sink opened again
        serves nothing of the previous run)."""
        self._gpu_values: dict[str, dict[str, float]] = {}
        self._energy_j: dict[str, float] = {}
        self._scalars: dict[str, float] = {}
        self._steps_total = 0.0
        self._last_step: float | None = None
        self._last_step_time: float | None = None

    @staticmethod
    def spec_options(arg: str | None) -> dict[str, Any]:
        """``"9401"``, ``"0"`` (free port) or ``"HOST:PORT"``; ``None`` -> 9401 on 127.0.0.1."""
        return host_port_options("prometheus", arg,
                                 "'prometheus:PORT' or 'prometheus:HOST:PORT'")

    @staticmethod
    def check_options(options: dict[str, Any]) -> dict[str, Any]:
        """``ValueError`` (one line) for a port outside 0-65535."""
        check_port("prometheus", options.get("port", DEFAULT_PORT))
        return options

    @staticmethod
    def prepare_options(options: dict[str, Any]) -> dict[str, Any]:
        """At start: ``ValueError`` if the port is taken."""
        host, port = options.get("host", "127.0.0.1"), options.get("port", DEFAULT_PORT)
        taken = port_taken(host, port)
        if taken is not None:
            raise ValueError(_cannot_serve(host, port, taken))
        return options

    @classmethod
    def from_spec(cls, arg: str | None) -> PrometheusSink:
        """The sink of ``"prometheus:..."``, built here."""
        return cls(**cls.check_options(cls.spec_options(arg)))

    def for_node(self, node: int) -> PrometheusSink:
        """The exporter a distributed job's node ``node`` serves (on its own host: the same
        address and port), with its node's GPUs labelled by node and rank."""
        return PrometheusSink(self.port, self.host, self.training, http=self.http)

    @staticmethod
    def node_options(options: dict[str, Any], node: int) -> dict[str, Any]:
        """The options of :meth:`for_node`'s sink, for a sink chosen by name: the same."""
        return dict(options)

    def open(self, context: RunContext) -> None:
        """Start the HTTP server thread; ``ValueError`` if the port cannot be bound.  A sink
        opened again (a monitor started again with the same sink object) starts empty: no
        series of the previous run, its energy counters from 0."""
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as e:
            raise ImportError(
                "the prometheus sink needs prometheus_client: pip install 'gpulens[prometheus]'"
            ) from e
        with self._lock:
            self._context = context
            self._clear()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        self._registry = registry
        if not self.http:
            return
        try:
            server, thread = start_http_server(self.port, addr=self.host, registry=registry)
        except OSError as e:
            raise ValueError(_cannot_serve(self.host, self.port, e)) from None
        self._server, self._thread = server, thread
        self.port = int(server.server_port)

    def write(self, row: Row) -> None:
        """Keep the row's values as the latest; add its energy to the counters."""
        gpu: dict[str, dict[str, float]] = {}
        scalars: dict[str, float] = {}
        for key, value in row.values.items():
            if not isinstance(value, int | float) or not math.isfinite(value):
                continue
            m = _GPU_KEY.match(key)
            if m is not None:
                gpu.setdefault(m.group(1), {})[m.group(2)] = float(value)
            elif key.startswith("host/") or (
                self.training and key.startswith(("train/", *_ENGINE_PREFIXES))
            ):
                scalars[key] = float(value)
        with self._lock:
            # the latest row's GPUs only: a GPU the row no longer carries (lost mid-run) is
            # gone from the next scrape, never its last values carried forward
            self._gpu_values = gpu
            for index, values in gpu.items():
                if "energy_j" in values:
                    self._energy_j[index] = self._energy_j.get(index, 0.0) + values["energy_j"]
            # the engine's figures are the latest row's: one it no longer gives is gone
            for key in [k for k in self._scalars if k.startswith(_ENGINE_PREFIXES)]:
                del self._scalars[key]
            self._scalars.update(scalars)
            if self.training:
                steps = scalars.get("perf/steps")
                if steps is not None:
                    self._steps_total += steps
                step = scalars.get("train/global_step", float(row.step))
                if self._last_step is None or step != self._last_step:
                    self._last_step = step
                    self._last_step_time = row.time

    def close(self) -> None:
        """Stop the HTTP server."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus's text format, and its content type (for a server that
        is not the sink's own); ``RuntimeError`` before ``open()``."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self._registry is None:
            raise RuntimeError("prometheus sink: exposition() before open()")
        return generate_latest(self._registry), CONTENT_TYPE_LATEST

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def snapshot(self) -> tuple[RunContext | None, dict[str, dict[str, float]], dict[str, float],
                                dict[str, float], tuple[float, float | None, float | None]]:
        """A consistent copy of the state, for the collector."""
        with self._lock:
            return (
                self._context,
                {k: dict(v) for k, v in self._gpu_values.items()},
                dict(self._energy_j),
                dict(self._scalars),
                (self._steps_total, self._last_step, self._last_step_time),
            )


class _Collector:
    """Turns the sink's latest state into metric families at scrape time."""

    def __init__(self, sink: PrometheusSink) -> None:
        self._sink = sink

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        context, gpu_values, energy, scalars, steps = self._sink.snapshot()
        host = _host(context)
        infos, placed = _gpus(context)
        indices = sorted(set(infos) | set(gpu_values) | set(energy), key=int)

        def labels(index: str) -> list[str]:
            info = infos.get(index)
            node, rank = placed.get(index, ("", ""))
            return [index, info.uuid if info else "", info.name if info else "", host, node,
                    rank]

        info_f = GaugeMetricFamily("gpulens_gpu_info", "GPU identity (value 1)",
                                   labels=[*_GPU_LABELS, "pci_bus_id"])
        total_f = GaugeMetricFamily("gpulens_gpu_memory_total_bytes", "device memory total",
                                    labels=list(_GPU_LABELS))
        for index in indices:
            info = infos.get(index)
            info_f.add_metric([*labels(index), info.pci_bus_id if info else ""], 1.0)
            if info is not None and info.mem_total_gb:
                total_f.add_metric(labels(index), info.mem_total_gb * 1e9)
        yield info_f
        if total_f.samples:
            yield total_f

        for suffix, (name, scale) in GPU_SERIES.items():
            base = suffix.removesuffix("_max")
            meta = GPU_METRIC_BY_KEY.get(base)
            text = (meta.help if meta else suffix) + (" (peak in the window)" if
                                                      suffix.endswith("_max") else "")
            fam = GaugeMetricFamily(name, text, labels=list(_GPU_LABELS))
            for index in indices:
                v = gpu_values.get(index, {}).get(suffix)
                if v is not None:
                    fam.add_metric(labels(index), v * scale)
            if fam.samples:
                yield fam

        thr = GaugeMetricFamily(
            "gpulens_gpu_clocks_throttled_percent",
            "share of the window with clocks held down; reason: any, power (cap), thermal",
            labels=[*_GPU_LABELS, "reason"],
        )
        for index in indices:
            for suffix, reason in THROTTLE_SERIES.items():
                v = gpu_values.get(index, {}).get(suffix)
                if v is not None:
                    thr.add_metric([*labels(index), reason], v)
        if thr.samples:
            yield thr

        en = CounterMetricFamily(
            "gpulens_gpu_energy_joules",
            "energy used since the exporter started (NVML energy counter differences)",
            labels=list(_GPU_LABELS),
        )
        for index in indices:
            if index in energy:
                en.add_metric(labels(index), energy[index])
        if en.samples:
            yield en

        steps_total, last_step, last_step_time = steps
        if last_step is not None:
            yield _gauge(GaugeMetricFamily, "gpulens_train_step",
                         "training step (train/global_step) of the latest row", host, last_step)
        if last_step_time is not None:
            yield _gauge(GaugeMetricFamily, "gpulens_train_last_step_timestamp_seconds",
                         "Unix time at which the training step last advanced", host,
                         last_step_time)
        if self._sink.training and (last_step is not None or steps_total):
            steps_f = CounterMetricFamily("gpulens_train_steps",
                                          "training steps seen (perf/steps)", labels=["host"])
            steps_f.add_metric([host], steps_total)
            yield steps_f
        yield from job_families(scalars, host)
        if self._sink.training:
            yield from _engine_families(context, scalars, host)
        seen: set[str] = set()
        for key, value in sorted(scalars.items()):
            if key in ("train/global_step", "perf/steps") or key.startswith(
                    ("alerts/", "rank/", "node/", "job/")):
                continue
            name, scale = scalar_series_name(key)
            if name in seen:
                continue
            seen.add(name)
            text = PERF_SERIES[key][2] if key in PERF_SERIES else f"{key} of the latest row"
            yield _gauge(GaugeMetricFamily, name, text, host, value * scale)


def _host(context: RunContext | None) -> str:
    """The ``host`` label: the node's name in a distributed job (``GPULENS_NODE_NAME`` where
    set), else the host name."""
    if context is None:
        return ""
    job = getattr(context, "job", None)
    if job is not None and context.gpus:
        own = context.gpus[0].index
        for r in job.ranks:
            if any(g.index == own for g in r.gpus):
                return str(r.node_name)
    return context.hostname


def _gpus(context: RunContext | None) -> tuple[dict[str, GpuInfo], dict[str, tuple[str, str]]]:
    """Every GPU of the context (a distributed job's node: each of its ranks') by row index,
    and each one's (node, rank) labels ("" outside a distributed job)."""
    if context is None:
        return {}, {}
    infos = {str(g.index): g for g in context.gpus}
    placed: dict[str, tuple[str, str]] = {}
    job = getattr(context, "job", None)
    if job is not None:
        for r in job.ranks:
            for g in r.gpus:
                infos.setdefault(str(g.index), g)
                placed[str(g.index)] = (str(r.node), str(r.rank))
    return infos, placed


def _engine_families(context: RunContext | None, scalars: dict[str, float],
                     host: str) -> Iterator[Any]:
    """The labelled series of the engine's figures: alerts by rule, CPU time by rank, and
    MFU's denominator from the run's metadata."""
    from prometheus_client.core import GaugeMetricFamily

    alerts = GaugeMetricFamily(ALERT, "1 while gpulens's advice rule fires (alerts/<rule>), "
                               "0 while it does not; see the events for what to try",
                               labels=["host", "rule"])
    busy = GaugeMetricFamily(CPU_BUSY[0], CPU_BUSY[1], labels=["host", "rank"])
    for key, value in sorted(scalars.items()):
        if key.startswith("alerts/"):
            alerts.add_metric([host, key.removeprefix("alerts/")], value)
        elif (m := _RANK_KEY.match(key)) is not None:
            busy.add_metric([host, m.group(1)], value)
    for fam in (alerts, busy):
        if fam.samples:
            yield fam
    meta = context.meta if context is not None else {}
    peak = meta.get("peak_tflops")
    if isinstance(peak, int | float) and math.isfinite(peak) and peak > 0:
        fam = GaugeMetricFamily(PEAK, "MFU's denominator: one GPU's dense peak FLOP/s in the "
                                "run's dtype (peak_gpu, dtype; source in the run's metadata)",
                                labels=["host", "peak_gpu", "dtype"])
        fam.add_metric([host, str(meta.get("peak_gpu", "")),
                        str(meta.get("peak_dtype") or meta.get("dtype", ""))], peak * 1e12)
        yield fam


def _gauge(cls: Any, name: str, text: str, host: str, value: float) -> Any:
    fam = cls(name, text, labels=["host"])
    fam.add_metric([host], value)
    return fam
