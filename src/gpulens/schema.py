"""The one metric schema shared by every sink.

A row is a flat ``dict[str, float | int]``.  Keys follow DESIGN.md:

* ``gpu/{i}/{metric}`` for GPU ``i`` (unique across the whole job: the global rank in a
  distributed job, the device index otherwise),
* ``gpu/all/{metric}_mean|_min|_max`` job-level aggregates when more than one GPU is in the row,
* ``host/{metric}`` for the host,
* ``perf/{metric}`` for step anatomy,
* ``train/{name}`` for the scalars the training loop passes to :meth:`gpulens.Monitor.log`,
  with ``train/global_step`` as the shared x-axis.

A metric the device cannot report is *absent* from the row, never 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Agg(Enum):
    """How a window turns the samples of one metric into the logged value."""

    MEAN = "mean"
    """Time-weighted mean over the window (trapezoid integral / window length)."""
    DELTA = "delta"
    """Counter difference over the window (energy)."""
    LAST = "last"
    """The last value seen in the window (static limits, allocator peak)."""


@dataclass(frozen=True)
class GpuMetric:
    """One per-GPU metric: its key suffix, unit, aggregation and Prometheus name."""

    key: str
    unit: str
    agg: Agg
    help: str
    with_max: bool = False
    """Also log ``{key}_max``, the largest sample in the window (where the peak matters)."""


GPU_METRICS: tuple[GpuMetric, ...] = (
    GpuMetric("util_pct", "percent", Agg.MEAN,
              "NVML utilization: share of time any kernel ran (driver's buffered samples)"),
    GpuMetric("sm_active_pct", "percent", Agg.MEAN,
              "GPM: share of SMs that were busy (NVML_GPM_METRIC_SM_UTIL; Hopper+)"),
    GpuMetric("sm_occupancy_pct", "percent", Agg.MEAN,
              "GPM: active warps as a share of the theoretical maximum (Hopper+)"),
    GpuMetric("tensor_active_pct", "percent", Agg.MEAN,
              "GPM: share of time the SMs ran any tensor-core operation (Hopper+)"),
    GpuMetric("dram_bw_pct", "percent", Agg.MEAN,
              "GPM: DRAM bandwidth used as a share of the theoretical maximum (Hopper+)"),
    GpuMetric("mem_used_gb", "GB", Agg.MEAN, "device memory used (1 GB = 1e9 bytes)",
              with_max=True),
    GpuMetric("mem_pct", "percent", Agg.MEAN, "device memory used as a share of total"),
    GpuMetric("power_w", "W", Agg.MEAN, "board power draw", with_max=True),
    GpuMetric("power_limit_w", "W", Agg.LAST, "enforced power limit"),
    GpuMetric("energy_j", "J", Agg.DELTA,
              "energy used in the window: the driver's 20 ms power samples integrated, "
              "calibrated to NVML's energy counter over spans of at least 1 s"),
    GpuMetric("energy_err_j", "J", Agg.DELTA,
              "stated bound on the error of energy_j in this window"),
    GpuMetric("energy_short_window", "flag", Agg.LAST,
              "1 when the window is shorter than the energy counter's update period (~100 ms): "
              "its energy rests on the power samples alone"),
    GpuMetric("temp_c", "Celsius", Agg.MEAN, "GPU core temperature", with_max=True),
    GpuMetric("sm_clock_mhz", "MHz", Agg.MEAN, "SM clock"),
    GpuMetric("mem_clock_mhz", "MHz", Agg.MEAN, "memory clock"),
    GpuMetric("nvlink_rx_gb_per_s", "GB/s", Agg.MEAN,
              "NVLink data received, all links (GPM where the GPU has it, else NVML's NVLink "
              "data counters), 1 GB = 1e9 bytes"),
    GpuMetric("nvlink_tx_gb_per_s", "GB/s", Agg.MEAN,
              "NVLink data sent, all links (GPM, else NVML's counters)"),
    GpuMetric("pcie_rx_gb_per_s", "GB/s", Agg.MEAN,
              "PCIe traffic to the GPU (GPM, else NVML's PCIe byte counters)"),
    GpuMetric("pcie_tx_gb_per_s", "GB/s", Agg.MEAN,
              "PCIe traffic from the GPU (GPM, else NVML's PCIe byte counters)"),
    GpuMetric("throttle_pct", "percent", Agg.MEAN,
              "share of the window with clocks held down (power cap, thermal, HW slowdown)"),
    GpuMetric("throttle_power_pct", "percent", Agg.MEAN,
              "share of the window with clocks held down by the power cap"),
    GpuMetric("throttle_thermal_pct", "percent", Agg.MEAN,
              "share of the window with clocks held down by temperature"),
    GpuMetric("torch_allocated_gb", "GB", Agg.LAST,
              "bytes held by this process's torch caching allocator for tensors"),
    GpuMetric("torch_peak_gb", "GB", Agg.LAST,
              "torch.cuda.max_memory_allocated: the peak since the process started or the "
              "training code last reset it (gpulens never resets it)"),
    GpuMetric("torch_alloc_retries", "count", Agg.LAST,
              "the torch caching allocator's cudaMalloc retries since the process started "
              "(memory_stats num_alloc_retries: it had to free cached blocks to allocate)"),
    GpuMetric("torch_ooms", "count", Agg.LAST,
              "out-of-memory errors the torch allocator raised since the process started"),
)

GPU_METRIC_BY_KEY: dict[str, GpuMetric] = {m.key: m for m in GPU_METRICS}

GPU_ROW_KEYS: tuple[str, ...] = (
    *(k for m in GPU_METRICS for k in ((m.key, m.key + "_max") if m.with_max else (m.key,))),
    "samples",
)
"""Every suffix that can follow ``gpu/{i}/`` in a row, in a fixed order (also the layout of the
fixed-size tensor that distributed jobs gather)."""

HOST_KEYS: tuple[str, ...] = ("cpu_pct", "ram_used_gb")

FULL_GPUS = 8
"""Distributed jobs of up to this many GPUs (one per rank) keep every GPU's figures in rank 0's
row and in the trackers; larger ones give the trackers job figures, per-node figures of the
worst nodes and the worst GPUs in fixed slots (the tracker view's key budget)."""
FULL_GPUS_ENV = "GPULENS_FULL_GPUS"


def full_gpus() -> int:
    """:data:`FULL_GPUS`, or lower where ``GPULENS_FULL_GPUS`` says (1 to 8: a smaller job
    then gets the view of a large one; never higher, which would break the key budget)."""
    import os

    raw = os.environ.get(FULL_GPUS_ENV, "").strip()
    if not raw:
        return FULL_GPUS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= FULL_GPUS:
        raise ValueError(f"{FULL_GPUS_ENV}={raw!r}: expected a whole number from 1 to "
                         f"{FULL_GPUS}")
    return value

BOOKKEEPING_SUFFIXES = frozenset({"samples", "energy_err_j", "energy_short_window",
                                  "power_limit_w", "torch_alloc_retries", "torch_ooms"})
"""Per-GPU keys the trackers do not get (JSONL and Prometheus keep them): about the measurement
rather than the GPU (samples, the energy's error bound), static (the power limit: in the run's
config), or cumulative counts that an advice rule watches (allocator retries and OOMs).  Six
charts a GPU fewer keep a job of 8 GPUs under the key budget."""

STEP_KEY = "train/global_step"


def gpu_key(index: int | str, suffix: str) -> str:
    """``gpu/{index}/{suffix}``."""
    return f"gpu/{index}/{suffix}"


def train_key(name: str) -> str:
    """A scalar name without ``/`` becomes ``train/<name>``; names with ``/`` are kept."""
    return name if "/" in name else f"train/{name}"
