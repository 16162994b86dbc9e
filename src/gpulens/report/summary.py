"""Per-GPU and per-run summaries of a sequence of rows.

Used by ``gpulens report`` (rows read back from a JSONL record) and ``gpulens record`` (rows
handed over live by :class:`gpulens.sinks.summary.SummarySink`).  Rows are folded one at a time,
so a long recording costs constant memory.

Every row covers a window that ends at its ``time``; the window of row *n* starts at the time of
row *n-1*.  Means are weighted by window length in seconds, so an uneven logging cadence does not
bias them.  The first row's window is ``perf/step_time_s * perf/steps`` when the row says so,
else the ``start_time`` handed to the builder, else the median of the later windows.  Several
runs (``begin_run``) each start a chain of windows of their own: the gap between two runs is
no window, and the duration is the sum of the runs' durations.

The mean step time is the duration divided by the steps (not a mean of the rows' step times,
which would weight each step time by its own length).

What a summary holds per GPU (absent metrics stay ``None``, never 0):

* activity: mean/max of GPM ``sm_active_pct`` where present, else of NVML ``util_pct``
  (``activity_metric`` names which); ``tensor_active_pct`` mean where present,
* peak memory in GB (``mem_used_gb_max`` or ``mem_used_gb``) and total memory where known,
* mean/max power in W and the power limit,
* mean/max temperature in degrees Celsius,
* energy in Wh: the sum of the rows' ``energy_j`` (NVML's counter differences); rows without it
  add ``power_w`` times their window length (``energy_source`` says which was used),
* the share of time and the seconds the clocks were held down, in total and by cause
  (power cap, thermal).

For the run, where the rows carry the engine's work figures (``perf/tokens_per_s`` or
``perf/samples_per_s``, ``perf/tflops``, ``perf/mfu_pct`` ...), :class:`Throughput` holds their
run-level values: each rate weighted by its window's length (``perf/step_time_s *
perf/steps``), so it is the run's total work over the time of those windows, not a mean of
ratios; work per joule is the work over the GPU energy of its windows.  The run's one
efficiency figure (:class:`Efficiency`) is then the engine's tokens (samples) per joule, unless
the caller hands in the work done (``gpulens report --work N``).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

_GPU_KEY = re.compile(r"^gpu/(\d+)/([a-z0-9_]+)$")


@dataclass
class _Stat:
    """Time-weighted mean, max and last value of one metric."""

    wsum: float = 0.0
    weight: float = 0.0
    max: float = -math.inf
    last: float | None = None
    count: int = 0

    def add(self, value: float, weight: float, peak: float | None = None) -> None:
        self.wsum += value * weight
        self.weight += weight
        self.max = max(self.max, value if peak is None else max(value, peak))
        self.last = value
        self.count += 1

    @property
    def mean(self) -> float | None:
        if self.count == 0:
            return None
        if self.weight <= 0:
            return self.last
        return self.wsum / self.weight

    @property
    def maximum(self) -> float | None:
        return None if self.count == 0 else self.max


@dataclass
class GpuSummary:
    """Summary of one GPU over a run.  Units: percent, GB, W, Celsius, Wh, seconds."""

    gpu: str
    """The GPU's key in rows (``gpu/{gpu}/...``)."""
    name: str | None = None
    activity_metric: str | None = None
    """``"sm_active_pct"`` (GPM) or ``"util_pct"`` (NVML utilization), ``None`` if neither."""
    activity_mean_pct: float | None = None
    activity_max_pct: float | None = None
    util_mean_pct: float | None = None
    sm_active_mean_pct: float | None = None
    tensor_active_mean_pct: float | None = None
    mem_peak_gb: float | None = None
    mem_total_gb: float | None = None
    power_mean_w: float | None = None
    power_max_w: float | None = None
    power_limit_w: float | None = None
    temp_mean_c: float | None = None
    temp_max_c: float | None = None
    energy_wh: float | None = None
    energy_source: str | None = None
    """``"counter"`` (NVML energy counter), ``"power x time"`` (estimate) or ``"mixed"``."""
    throttle_pct: float | None = None
    """Share of the run's time with clocks held down, any cause."""
    throttle_power_pct: float | None = None
    throttle_thermal_pct: float | None = None
    throttled_s: float | None = None
    throttled_power_s: float | None = None
    throttled_thermal_s: float | None = None

    def throttle_reasons(self) -> str:
        """``"power cap 12.0 s, thermal 1.5 s"``, or ``"none"`` / ``"n/a"``."""
        if self.throttle_pct is None:
            return "n/a"
        parts = []
        if self.throttled_power_s:
            parts.append(f"power cap {self.throttled_power_s:.1f} s")
        if self.throttled_thermal_s:
            parts.append(f"thermal {self.throttled_thermal_s:.1f} s")
        other = (self.throttled_s or 0.0) - (self.throttled_power_s or 0.0) - (
            self.throttled_thermal_s or 0.0
        )
        if other > 0.05:
            parts.append(f"other {other:.1f} s")
        return ", ".join(parts) if parts else "none"


@dataclass
class Efficiency:
    """Work done per energy: ``work`` units (tokens, samples, requests) over the run."""

    work: float
    unit: str
    per_joule: float | None
    """The efficiency figure: units of work per joule of GPU energy (all GPUs; the energy
    counter where the GPUs have one, else mean power x time)."""
    per_second: float | None
    """Throughput: units of work per second of the run's duration."""
    source: str = "given"
    """``"given"``: ``work`` was handed in (``--work``), over the whole run's energy and
    duration; ``"engine"``: the rows' own ``perf/tokens_per_j`` (``samples_per_j``) and
    ``perf/tokens_per_s`` figures (:class:`Throughput`), over the windows that have them."""


@dataclass
class Throughput:
    """The run's throughput and MFU from the engine's per-window ``perf/*`` figures.

    Rates are weighted by window length (seconds), so ``per_s`` is the work of those windows
    over their time and ``mfu_pct`` the model FLOPs over (time x GPUs x peak); ``None`` where
    no row has the figure.
    """

    unit: str
    """``"tokens"`` (``perf/tokens_per_s``) or ``"samples"`` (``perf/samples_per_s``, where
    the run reports no tokens)."""
    work: float | None = None
    """Tokens (samples) in the windows with a rate."""
    per_s: float | None = None
    """Tokens (samples) per second of those windows, all GPUs together."""
    per_j: float | None = None
    """Tokens (samples) per joule of the GPUs' energy in the windows with ``perf/*_per_j``."""
    tflops: float | None = None
    """Achieved model TFLOP/s per GPU (``perf/tflops``)."""
    tflops_job: float | None = None
    """Achieved model TFLOP/s of all the GPUs (``perf/tflops_job``)."""
    mfu_pct: float | None = None
    """``perf/mfu_pct``: achieved / the GPU's dense peak in the run's dtype, %."""
    mfu_clock_adjusted_pct: float | None = None
    """``perf/mfu_clock_adjusted_pct``: against the peak scaled to the SM clock it ran at, %."""
    tensor_active_pct: float | None = None
    """GPM tensor-pipe activity (mean over the GPUs) in the windows with an MFU, %."""
    mfu_when_tensor_active_pct: float | None = None
    """``mfu_pct`` / ``tensor_active_pct``: the share of peak the tensor cores gave while
    they were busy (low: busy but slow; high while ``tensor_active_pct`` is low: idle)."""
    windows: int = 0
    """Rows with a throughput or MFU figure."""


@dataclass
class RunSummary:
    """Summary of a whole run: per GPU, plus training and energy figures across GPUs."""

    rows: int = 0
    duration_s: float | None = None
    start_time: float | None = None
    end_time: float | None = None
    first_step: int | None = None
    last_step: int | None = None
    steps: int | None = None
    """Training steps covered (sum of ``perf/steps`` where rows carry it)."""
    gpus: list[GpuSummary] = field(default_factory=list)
    energy_wh: float | None = None
    """All GPUs together."""
    power_mean_w: float | None = None
    """All GPUs together over the run's duration (each GPU's mean power times the share of
    the run its rows cover, summed)."""
    energy_gpus: int = 0
    """GPUs whose energy :attr:`energy_wh` sums (fewer than :attr:`gpus` where some GPU cannot
    report it)."""
    power_gpus: int = 0
    """GPUs whose power :attr:`power_mean_w` sums."""
    energy_per_step_j: float | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    loss_min: float | None = None
    not_finite: dict[str, list[int]] = field(default_factory=dict)
    """Training scalars that were NaN or infinite in some rows (a diverging loss):
    ``train/<name>`` -> [rows, first step]."""
    step_time_mean_s: float | None = None
    """Duration / steps, where the rows are training steps that time themselves
    (``perf/step_time_s`` beside training scalars)."""
    efficiency: Efficiency | None = None
    throughput: Throughput | None = None
    """Throughput and MFU, where the rows carry the engine's ``perf/*`` work figures."""
    meta: dict[str, str | float] = field(default_factory=dict)
    """The run's metadata (the JSONL header's ``meta``): dtype, MFU's peak and its source."""
    runs: int = 0
    """Runs folded in (each with its own chain of windows)."""
    backend: str | None = None
    """What sampled the GPUs: ``"nvml"``, ``"simulated"``, ``"none"``; ``None`` if unknown."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``None`` stays ``null``)."""
        return asdict(self)


class SummaryBuilder:
    """Fold rows (``step``, ``time``, values) into a :class:`RunSummary`.

    Args:
        gpu_names: GPU key -> model name, for the table.
        mem_total_gb: GPU key -> total memory in GB, where known.
        start_time: Unix time the first window started (the monitor's start), if known.
        backend: what sampled the GPUs (``"nvml"``, ``"simulated"``, ``"none"``), if known.
        meta: the run's metadata (dtype, MFU's peak ...), copied into the summary.
    """

    def __init__(
        self,
        gpu_names: Mapping[str, str] | None = None,
        mem_total_gb: Mapping[str, float] | None = None,
        start_time: float | None = None,
        backend: str | None = None,
        meta: Mapping[str, str | float] | None = None,
    ) -> None:
        self._backend = backend
        self._meta = dict(meta or {})
        self._perf: dict[str, _Stat] = {}
        self._per_j = [0.0, 0.0, 0.0, 0.0]  # tokens x J, J, samples x J, J
        self._names = dict(gpu_names or {})
        self._mem_total = dict(mem_total_gb or {})
        self._start = start_time
        self._prev_time: float | None = None
        self._spans: list[list[float | None]] = []  # per run: [first row time, window, last]
        self._pending_first: list[tuple[int, dict[str, float], list[float | None]]] = []
        self._dts: list[float] = []
        self._gpu: dict[str, dict[str, _Stat]] = {}
        self._energy: dict[str, tuple[float, int, int]] = {}  # j, counter rows, estimated rows
        self._rows = 0
        self._steps_sum = 0.0
        self._steps_seen = False
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._loss: list[float] = []  # first, last, min
        self._not_finite: dict[str, list[int]] = {}
        self._step_time = _Stat()
        self._trained = False  # rows with training scalars (not `gpulens record` intervals)

    def begin_run(self, start_time: float | None = None) -> None:
        """The next row is the first of another run (which started at ``start_time``, unix
        seconds, if known): its window does not reach back to the previous run."""
        self._start = start_time
        self._prev_time = None

    def add(self, step: int, time: float, values: Mapping[str, float]) -> None:
        """Fold in one row.  Rows of one run must come in time order."""
        self._rows += 1
        for key, value in values.items():
            if not math.isfinite(value) and key.startswith("train/"):
                seen = self._not_finite.setdefault(key, [0, step])
                seen[0] += 1
                seen[1] = min(seen[1], step)
        if self._prev_time is None:  # the first row of a run
            window = self._first_row_window(time, values)
            span: list[float | None] = [time, window, time]
            self._spans.append(span)
            if window is None:
                # decided at the end, from the median of the later windows
                self._pending_first.append((step, dict(values), span))
            else:
                self._fold(step, values, window)
        else:
            dt = max(0.0, time - self._prev_time)
            self._dts.append(dt)
            self._fold(step, values, dt)
            self._spans[-1][2] = max(time, self._spans[-1][2] or time)
        self._prev_time = time

    def _first_row_window(self, time: float, values: Mapping[str, float]) -> float | None:
        st, n = values.get("perf/step_time_s"), values.get("perf/steps")
        if st is not None and n is not None and st > 0 and n > 0:
            return float(st) * float(n)
        if self._start is not None and time > self._start:
            return time - self._start
        return None

    def _fold(self, step: int, values: Mapping[str, float], weight: float) -> None:
        if self._first_step is None or step < self._first_step:
            self._first_step = step
        if self._last_step is None or step > self._last_step:
            self._last_step = step
        n = values.get("perf/steps")
        if n is not None:
            self._steps_sum += float(n)
            self._steps_seen = True
        loss = values.get("train/loss")
        if loss is not None and math.isfinite(loss):
            if not self._loss:
                self._loss = [loss, loss, loss]
            else:
                self._loss[1] = loss
                self._loss[2] = min(self._loss[2], loss)
        st = values.get("perf/step_time_s")
        if st is not None:
            self._step_time.add(float(st), weight)
        if not self._trained:
            self._trained = any((k.startswith("train/") and k != "train/global_step")
                                or k in _WORK_RATES for k in values)
        if any(k in values for k in _PERF_TRIGGER):
            self._fold_perf(values, weight)
        per_gpu: dict[str, dict[str, float]] = {}
        for key, value in values.items():
            m = _GPU_KEY.match(key)
            if m is None or not isinstance(value, int | float) or not math.isfinite(value):
                continue
            per_gpu.setdefault(m.group(1), {})[m.group(2)] = float(value)
        for gpu, metrics in per_gpu.items():
            stats = self._gpu.setdefault(gpu, {})
            for suffix in (
                "util_pct", "sm_active_pct", "tensor_active_pct", "mem_used_gb", "mem_pct",
                "power_w", "power_limit_w", "temp_c", "throttle_pct", "throttle_power_pct",
                "throttle_thermal_pct",
            ):
                if suffix in metrics:
                    stats.setdefault(suffix, _Stat()).add(
                        metrics[suffix], weight, metrics.get(suffix + "_max")
                    )
            if "mem_used_gb" in metrics and "mem_pct" in metrics and metrics["mem_pct"] > 0:
                self._mem_total.setdefault(gpu, metrics["mem_used_gb"] / metrics["mem_pct"] * 100)
            j, counted, estimated = self._energy.get(gpu, (0.0, 0, 0))
            if "energy_j" in metrics:
                self._energy[gpu] = (j + metrics["energy_j"], counted + 1, estimated)
            elif "power_w" in metrics:
                self._energy[gpu] = (j + metrics["power_w"] * weight, counted, estimated + 1)

    def _fold_perf(self, values: Mapping[str, float], weight: float) -> None:
        """The engine's work figures of one row, weighted by its window (the engine's own
        ``perf/step_time_s * perf/steps`` where the row has them)."""
        st, n = values.get("perf/step_time_s"), values.get("perf/steps")
        window = float(st) * float(n) if st is not None and n is not None and st > 0 and n > 0 \
            else weight
        for key in _PERF_KEYS:
            v = values.get(key)
            if v is not None and math.isfinite(v):
                self._perf.setdefault(key, _Stat()).add(float(v), window)
        tensors = [v for k, v in values.items()
                   if k.endswith("/tensor_active_pct") and _GPU_KEY.match(k) and math.isfinite(v)]
        mfu = values.get("perf/mfu_pct")
        if tensors and mfu is not None and math.isfinite(mfu):
            tensor = sum(tensors) / len(tensors)
            self._perf.setdefault("tensor", _Stat()).add(tensor, window)
            if "perf/mfu_when_tensor_active_pct" in values:  # the engine found it sound
                self._perf.setdefault("tensor_busy", _Stat()).add(tensor, window)
                self._perf.setdefault("mfu_with_tensor", _Stat()).add(float(mfu), window)
        energy = sum(v for k, v in values.items()
                     if k.endswith("/energy_j") and _GPU_KEY.match(k) and math.isfinite(v))
        if energy > 0:
            for i, key in ((0, "perf/tokens_per_j"), (2, "perf/samples_per_j")):
                v = values.get(key)
                if v is not None and math.isfinite(v):
                    self._per_j[i] += v * energy
                    self._per_j[i + 1] += energy

    def _throughput(self) -> Throughput | None:
        p = self._perf
        if not p:
            return None

        def mean(key: str) -> float | None:
            return p[key].mean if key in p else None

        tokens = "perf/tokens_per_s" in p or self._per_j[1] > 0
        unit, i = ("tokens", 0) if tokens else ("samples", 2)
        rate = p.get(f"perf/{unit}_per_s")
        out = Throughput(unit=unit, windows=max(s.count for s in p.values()))
        if rate is not None:
            out.per_s = rate.mean
            out.work = rate.wsum if rate.weight > 0 else None
        if self._per_j[i + 1] > 0:
            out.per_j = self._per_j[i] / self._per_j[i + 1]
        out.tflops, out.tflops_job = mean("perf/tflops"), mean("perf/tflops_job")
        out.mfu_pct = mean("perf/mfu_pct")
        out.mfu_clock_adjusted_pct = mean("perf/mfu_clock_adjusted_pct")
        out.tensor_active_pct = mean("tensor")
        # only the windows whose rows carry the quotient (a tensor-core dtype, within 100 %)
        both, busy = p.get("mfu_with_tensor"), p.get("tensor_busy")
        if both is not None and busy is not None and busy.wsum > 0:
            out.mfu_when_tensor_active_pct = 100.0 * both.wsum / busy.wsum
        return out

    def result(self, work: float | None = None, unit: str = "units") -> RunSummary:
        """The summary of the rows folded so far; ``work`` adds efficiency figures."""
        if self._pending_first:
            window = statistics.median(self._dts) if self._dts else 0.0
            for step, values, span in self._pending_first:
                span[1] = window
                self._fold(step, values, window)
            self._pending_first = []
        out = RunSummary(rows=self._rows, first_step=self._first_step, last_step=self._last_step,
                         runs=len(self._spans), backend=self._backend, meta=dict(self._meta),
                         throughput=self._throughput())
        if self._spans:
            starts = [(first or 0.0) - (window or 0.0) for first, window, _ in self._spans]
            out.start_time = min(starts)
            out.end_time = max(last or 0.0 for _, _, last in self._spans)
            out.duration_s = sum((last or 0.0) - start
                                 for start, (_, _, last) in zip(starts, self._spans, strict=True))
        if self._steps_seen:
            out.steps = round(self._steps_sum)
        elif self._first_step is not None and self._last_step is not None:
            out.steps = self._last_step - self._first_step + 1
        if self._loss:
            out.loss_first, out.loss_last, out.loss_min = self._loss
        out.not_finite = {k: list(v) for k, v in sorted(self._not_finite.items())}
        if self._step_time.count and self._trained and out.steps and out.duration_s:
            out.step_time_mean_s = out.duration_s / out.steps
        total_j = 0.0
        total_power = 0.0
        have_energy = have_power = False
        for gpu in sorted(self._gpu, key=int):
            g = self._gpu_summary(gpu, self._gpu[gpu], out.duration_s)
            out.gpus.append(g)
            if g.energy_wh is not None:
                total_j += g.energy_wh * 3600
                have_energy = True
                out.energy_gpus += 1
            if g.power_mean_w is not None:
                # a GPU's mean over the run's time, not only over its own rows (a GPU lost
                # mid-run drew nothing gpulens saw after it left)
                total_power += g.power_mean_w * _share(self._gpu[gpu]["power_w"], out.duration_s)
                have_power = True
                out.power_gpus += 1
        if have_energy:
            out.energy_wh = total_j / 3600
            if out.steps:
                out.energy_per_step_j = total_j / out.steps
        if have_power:
            out.power_mean_w = total_power
        if work is not None:
            per_s = work / out.duration_s if out.duration_s else None
            out.efficiency = Efficiency(
                work=work,
                unit=unit,
                per_joule=work / total_j if have_energy and total_j > 0 else None,
                per_second=per_s,
            )
        elif (tp := out.throughput) is not None and tp.per_j is not None and tp.work:
            out.efficiency = Efficiency(work=tp.work, unit=tp.unit, per_joule=tp.per_j,
                                        per_second=tp.per_s, source="engine")
        return out

    def _gpu_summary(self, gpu: str, s: dict[str, _Stat], duration: float | None) -> GpuSummary:
        g = GpuSummary(gpu=gpu, name=self._names.get(gpu), mem_total_gb=self._mem_total.get(gpu))

        def mean(k: str) -> float | None:
            return s[k].mean if k in s else None

        def peak(k: str) -> float | None:
            return s[k].maximum if k in s else None

        g.util_mean_pct = mean("util_pct")
        g.sm_active_mean_pct = mean("sm_active_pct")
        g.tensor_active_mean_pct = mean("tensor_active_pct")
        for metric in ("sm_active_pct", "util_pct"):
            if metric in s:
                g.activity_metric = metric
                g.activity_mean_pct = mean(metric)
                g.activity_max_pct = peak(metric)
                break
        g.mem_peak_gb = peak("mem_used_gb")
        g.power_mean_w = mean("power_w")
        g.power_max_w = peak("power_w")
        g.power_limit_w = s["power_limit_w"].last if "power_limit_w" in s else None
        g.temp_mean_c = mean("temp_c")
        g.temp_max_c = peak("temp_c")
        if gpu in self._energy:
            j, counted, estimated = self._energy[gpu]
            g.energy_wh = j / 3600
            g.energy_source = (
                "counter" if not estimated else "power x time" if not counted else "mixed"
            )
        g.throttle_pct = mean("throttle_pct")
        g.throttle_power_pct = mean("throttle_power_pct")
        g.throttle_thermal_pct = mean("throttle_thermal_pct")
        if duration is not None:
            # the share of the time this GPU's rows cover (a GPU lost mid-run: its own rows)
            if g.throttle_pct is not None:
                g.throttled_s = g.throttle_pct / 100 * _covered(s["throttle_pct"], duration)
            if g.throttle_power_pct is not None:
                g.throttled_power_s = g.throttle_power_pct / 100 * _covered(
                    s["throttle_power_pct"], duration)
            if g.throttle_thermal_pct is not None:
                g.throttled_thermal_s = g.throttle_thermal_pct / 100 * _covered(
                    s["throttle_thermal_pct"], duration)
        return g


def _covered(stat: _Stat, duration: float) -> float:
    """Seconds of the run that a metric's rows cover (their windows), at most the run's."""
    return min(stat.weight, duration) if stat.weight > 0 else duration


def _share(stat: _Stat, duration: float | None) -> float:
    """The share of the run's duration that a metric's rows cover (1 when unknown)."""
    if not duration or duration <= 0 or stat.weight <= 0:
        return 1.0
    return min(1.0, stat.weight / duration)


_PERF_KEYS = (
    "perf/tokens_per_s", "perf/samples_per_s", "perf/tflops", "perf/tflops_job", "perf/mfu_pct",
    "perf/mfu_clock_adjusted_pct",
)
"""The engine's work figures that are rates (weighted by window length); the per-joule
figures are weighted by the window's energy."""
_PERF_TRIGGER = (*_PERF_KEYS, "perf/tokens_per_j", "perf/samples_per_j")
_WORK_RATES = frozenset(("perf/tokens_per_s", "perf/samples_per_s", "perf/tflops"))
"""Keys only the work of training steps gives (rows with them are training steps)."""

__all__ = ["Efficiency", "GpuSummary", "RunSummary", "SummaryBuilder", "Throughput"]
