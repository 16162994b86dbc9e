"""Advice and alert rules: what the figures of finished rows mean.

A :class:`RuleEngine` reads each finished row (the engine calls :meth:`RuleEngine.feed` off the
training thread, in step order), keeps a short history per rule and per subject (a GPU, a rank,
or the whole job), and says when a rule starts or stops holding::

    rules = RuleEngine(RulesConfig(dtype="bf16", gpus=context.gpus, distributed=False))
    events = rules.feed(row_values, step, time)     # list[Event]: alerts firing / resolved,
                                                    # and one-off slow-rank notices
    row_values.update(rules.alert_keys())           # alerts/<rule>: 1.0 firing, 0.0 not

``alerts/<rule>`` is present once the rule has had its inputs at least once (a rule that cannot
judge, e.g. ``low_tensor_use`` of a run whose dtype is unknown, has no key: not available is
absent, never 0).  The engine never raises out of :meth:`~RuleEngine.feed`: a rule that fails is
switched off with one WARNING through the ``gpulens`` logger, and its key disappears.

How a rule decides (the same machinery for every rule)
------------------------------------------------------
Each row gives each subject of a rule an *observation*: at fire level (every condition of the
rule is past its fire threshold), at clear level (some condition is past its clear threshold),
in between, or none (the inputs are absent).  The *evidence* of a subject is its latest
observations, at least :attr:`RulesConfig.min_rows` (10) of them; where the figures are ones the
sampler averages over the window (GPU activity, power, clocks, memory used), they must also
cover at least :attr:`RulesConfig.min_span_s` (2 s) of wall-clock time, since a window of a few
milliseconds holds few samples.  Figures exact per step (step anatomy, CPU time per rank, the
allocator's counters and readings) need no span.  A rule

* **fires** for a subject when at least ``fire_share`` of its evidence is at fire level (80 %:
  8 of 10 windows) and the run has made at least :attr:`RulesConfig.min_steps` (20) steps;
* **clears** when at least ``clear_share`` of its evidence is at clear level (80 %).

Separate fire and clear thresholds plus the shares are the hysteresis: values hovering at a
threshold neither fire and clear in turn, nor fire on a noisy but healthy run.  A condition that
starts mid-run fires after 8 windows (for sampled figures: and about 1.6 s); a subject whose
inputs stop being reported for 20 rows and 30 s is resolved as "no longer measured" (never
carried forward).

Each rule's state is per subject; the rule's events are per rule: ``"firing"`` when a subject
starts firing (the message names every subject that fires, with its figures and what to try),
``"resolved"`` when the last one clears.  Every event that :meth:`RuleEngine.feed` returns
carries the step and time it was given (a one-off notice names the step of the spike in its
message and in ``data["spike_step"]``).

The rules, their thresholds and the keys they read
--------------------------------------------------
Thresholds live in :data:`RULES` (one table; ``integrations/prometheus/gpulens-rules.yml``
is checked against it by ``tests/test_rules_prometheus.py``).  Subjects: ``job``, ``gpu``
(``gpu/{i}``, the global rank in distributed rows) or ``rank``.

=====================  =======  ==============================================================
rule                   subject  fires when (clears when)
=====================  =======  ==============================================================
input_bound            job      ``perf/data_wait_pct`` >= 10 (< 5); where the row has no
                                ``perf/data_wait_pct``: NVML ``util_pct`` (mean of the GPUs
                                in use) <= 70 (> 80) and idle seconds per step,
                                ``(1 - util_pct/100) * perf/step_time_s``, >= 0.02 (< 0.01)
power_capped           gpu      ``throttle_power_pct`` >= 50 (< 20) and ``power_w`` /
                                ``power_limit_w`` >= 0.95 (< 0.9)
thermal                gpu      ``throttle_thermal_pct`` >= 10 (< 2)
low_tensor_use         gpu      bf16/fp16 runs only: ``sm_active_pct`` >= 50 (< 40) and
                                ``tensor_active_pct`` / ``sm_active_pct`` <= 0.1 (> 0.2)
under_used             gpu      ``sm_active_pct`` <= 30 (> 40); without GPM ``util_pct`` <= 50
                                (> 60); quiet in rows where input_bound is at fire level
memory_headroom        gpu      100 * (1 - ``mem_used_gb_max`` / total) <= 10 (> 15)
memory_alloc_retries   gpu      new ``torch_alloc_retries`` + ``torch_ooms`` >= 1 in a window,
                                in >= 20 % of the evidence (< 1 in all of it); a new OOM
                                fires at once
memory_creep           gpu      over the last 20 new ``torch_allocated_gb`` readings: robust
                                (Theil-Sen) growth >= 0.5 % of total memory (< 0.1 %) and
                                >= 70 % of reading pairs rising (< 55 %)
slow_rank              rank     busy time per step >= 20 % above the median of the other
                                ranks (< 10 %); from CPU time (no GPM) >= 50 % (< 25 %); a
                                single window >= 50 % above it, with the next 3 windows
                                < 20 %, is told once as a one-off notice
=====================  =======  ==============================================================

Keys read, per GPU ``i`` (``gpu/{i}/<suffix>``): ``util_pct``, ``sm_active_pct``,
``tensor_active_pct`` (GPM), ``throttle_power_pct``, ``throttle_thermal_pct``, ``power_w``,
``power_limit_w`` (else :attr:`GpuInfo.power_limit_w`), ``mem_used_gb_max`` (else
``mem_used_gb``), ``mem_pct`` (total memory where :attr:`GpuInfo.mem_total_gb` is unknown:
``mem_used_gb * 100 / mem_pct``), ``temp_c``, ``temp_c_max``, ``sm_clock_mhz``,
``torch_allocated_gb`` (the sampler carries one allocator reading, about one a second, into
the windows until the next: an unchanged value within 1 s is not a new reading) and two keys the
engine does not produce yet:

* ``gpu/{i}/torch_alloc_retries``: ``torch.cuda.memory_stats()["num_alloc_retries"]``, the
  cumulative count (the rule takes differences; a count that goes down starts a new baseline);
* ``gpu/{i}/torch_ooms``: ``torch.cuda.memory_stats()["num_ooms"]``, cumulative likewise.

Job keys: ``perf/data_wait_pct`` (``perf/data_wait_s`` for the message), ``perf/step_time_s``,
``perf/steps``.  Per rank ``r`` of a distributed job (rank 0's row holds every rank):

* ``rank/{r}/cpu_busy_s``: CPU seconds of rank ``r``'s training thread per step in the window
  (not produced yet).  Busy time per step is ``gpu/{r}/sm_active_pct / 100 *
  perf/step_time_s`` where every rank's GPU reports GPM, else ``rank/{r}/cpu_busy_s``: on a
  CPU-only DDP job the all-reduce makes wall-clock phases equal on every rank, but a rank slow in
  backward compute burns more CPU while the others wait.

A GPU is judged by ``under_used`` and the GPU-idle branch of ``input_bound`` only once it has
been seen in use (SM activity or NVML utilization >= 5 % in some window, or a
``torch_allocated_gb`` reading): the idle GPUs of a node that the job does not train on are not
"under-used".
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gpulens.log import warn_once
from gpulens.model import Event, GpuInfo

__all__ = [
    "RULES",
    "RuleEngine",
    "RuleSpec",
    "RulesConfig",
    "Threshold",
    "normalize_dtype",
    "rules_table",
]

Op = Literal[">=", "<="]


@dataclass(frozen=True)
class Threshold:
    """One figure a rule compares: at fire level when ``value <op> fire``; at clear level when
    the opposite side of ``clear`` holds (``value < clear`` for ``>=``, ``value > clear`` for
    ``<=``).  Between the two it is neither: that gap is the hysteresis."""

    name: str
    """Short name, unique within the rule (``"throttle_power"``)."""
    quantity: str
    """What is compared, in row keys (``gpu/{i}/throttle_power_pct``)."""
    op: Op
    fire: float
    clear: float
    unit: str
    doc: str

    def at_fire(self, value: float) -> bool:
        """``value`` is past the fire threshold."""
        return value >= self.fire if self.op == ">=" else value <= self.fire

    def at_clear(self, value: float) -> bool:
        """``value`` is past the clear threshold (on the healthy side)."""
        return value < self.clear if self.op == ">=" else value > self.clear


@dataclass(frozen=True)
class RuleSpec:
    """A rule: its name (``alerts/<name>``), subject, severity, thresholds and persistence."""

    name: str
    subject: Literal["job", "gpu", "rank"]
    severity: Literal["info", "warning", "critical"]
    title: str
    """What the rule says when it fires, in a few words."""
    thresholds: tuple[Threshold, ...]
    fire_share: float = 0.8
    """Share of the evidence at fire level that makes the rule fire."""
    clear_share: float = 0.8
    """Share of the evidence at clear level that clears it."""

    def threshold(self, name: str) -> Threshold:
        """The threshold called ``name``; ``KeyError`` if there is none."""
        for t in self.thresholds:
            if t.name == name:
                return t
        raise KeyError(f"rule {self.name} has no threshold {name!r}")


def _t(name: str, quantity: str, op: Op, fire: float, clear: float, unit: str,
       doc: str) -> Threshold:
    return Threshold(name, quantity, op, fire, clear, unit, doc)


RULES: dict[str, RuleSpec] = {
    spec.name: spec
    for spec in (
        RuleSpec("input_bound", "job", "warning", "input-bound: the GPUs wait for data", (
            _t("data_wait", "perf/data_wait_pct", ">=", 10.0, 5.0, "%",
               "share of the step spent waiting for the next batch (step anatomy)"),
            _t("gpu_util", "gpu/{i}/util_pct (mean of the GPUs in use)", "<=", 70.0, 80.0, "%",
               "NVML utilization, where the row has no perf/data_wait_pct"),
            _t("idle_s", "(1 - util_pct / 100) * perf/step_time_s", ">=", 0.02, 0.01, "s",
               "seconds per step with no kernel running, beside gpu_util"),
        )),
        RuleSpec("power_capped", "gpu", "info", "power-capped: clocks held down at the limit", (
            _t("throttle_power", "gpu/{i}/throttle_power_pct", ">=", 50.0, 20.0, "%",
               "share of the window with clocks held down by the power cap"),
            _t("power_share", "gpu/{i}/power_w / gpu/{i}/power_limit_w", ">=", 0.95, 0.90, "",
               "mean board power as a share of the enforced limit"),
        )),
        RuleSpec("thermal", "gpu", "warning", "thermal slowdown: clocks held down by heat", (
            _t("throttle_thermal", "gpu/{i}/throttle_thermal_pct", ">=", 10.0, 2.0, "%",
               "share of the window with clocks held down by temperature"),
        )),
        RuleSpec("low_tensor_use", "gpu", "warning",
                 "low tensor-core use in a bf16/fp16 run", (
            _t("sm_busy", "gpu/{i}/sm_active_pct", ">=", 50.0, 40.0, "%",
               "GPM SM activity: the rule judges busy GPUs only"),
            _t("tensor_share", "gpu/{i}/tensor_active_pct / gpu/{i}/sm_active_pct", "<=",
               0.10, 0.20, "", "tensor-pipe activity as a share of SM activity"),
        )),
        RuleSpec("under_used", "gpu", "warning", "GPU under-used: little work per step", (
            _t("sm_active", "gpu/{i}/sm_active_pct", "<=", 30.0, 40.0, "%",
               "GPM SM activity"),
            _t("util", "gpu/{i}/util_pct", "<=", 50.0, 60.0, "%",
               "NVML utilization, only where the GPU has no GPM"),
        )),
        RuleSpec("memory_headroom", "gpu", "warning", "little device memory left", (
            _t("headroom", "100 * (1 - gpu/{i}/mem_used_gb_max / total)", "<=", 10.0, 15.0,
               "%", "free share of device memory at the window's peak"),
        )),
        RuleSpec("memory_alloc_retries", "gpu", "warning",
                 "the torch allocator retried or ran out of memory", (
            _t("new_events", "new gpu/{i}/torch_alloc_retries + gpu/{i}/torch_ooms", ">=",
               1.0, 1.0, "count", "allocator retries and OOMs counted in the window"),
        ), fire_share=0.2, clear_share=1.0),
        RuleSpec("memory_creep", "gpu", "warning", "allocated memory creeps up step over step", (
            _t("growth", "Theil-Sen growth of gpu/{i}/torch_allocated_gb over the last 20 "
               "readings, % of total", ">=", 0.5, 0.1, "%",
               "robust growth over the span, as a share of device memory"),
            _t("rising", "share of reading pairs that rise", ">=", 70.0, 55.0, "%",
               "how consistently it grows (50 %: no trend)"),
        )),
        RuleSpec("slow_rank", "rank", "warning", "a slow rank sets the pace of the job", (
            _t("lag", "busy_s of rank r / median busy_s of the other ranks - 1, in %", ">=",
               20.0, 10.0, "%", "how much longer this rank is busy per step"),
            _t("lag_cpu", "the same lag where busy_s is the training thread's CPU time (ranks "
               "without GPM)", ">=", 50.0, 25.0, "%",
               "CPU time is a noisier signal: two healthy ranks doing the same work were seen "
               "~30 % apart for ten steps on a loaded host"),
            _t("one_off", "lag in a single window (told once as a notice)", ">=", 50.0, 20.0,
               "%", "a spike that the following windows do not repeat"),
        )),
    )
}
"""Every rule, by name, with its thresholds: the one source of truth."""

CREEP_READINGS = 20
"""``torch_allocated_gb`` readings the creep slope is fitted on."""
READING_GAP_S = 1.0
"""A row whose ``torch_allocated_gb`` equals the previous reading is a new reading only this
long after it (the sampler carries a reading into the windows until the next, ~1 s later)."""
ACTIVE_PCT = 5.0
"""SM activity or NVML utilization (%) that marks a GPU as in use by the job."""
STALE_ROWS = 20
STALE_S = 30.0
ONE_OFF_CONFIRM_ROWS = 3
"""Windows after a spike that must be back under the lag clear threshold to call it one-off."""
ONE_OFF_GAP_STEPS = 50
"""At most one one-off notice per rank in this many steps."""

_DTYPES = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16", "bf16-mixed": "bf16",
    "bf16-true": "bf16", "bf16_mixed": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "16": "fp16",
    "16-mixed": "fp16", "16-true": "fp16", "16_mixed": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "32": "fp32",
    "32-true": "fp32",
    "tf32": "tf32",
    "fp8": "fp8", "float8": "fp8", "transformer-engine": "fp8",
}


def normalize_dtype(dtype: object) -> str | None:
    """The run's compute dtype as ``"bf16"``, ``"fp16"``, ``"fp32"``, ``"tf32"``, ``"fp8"`` or
    ``None`` (unknown).  Takes torch dtypes, their names, Lightning precision flags
    (``"bf16-mixed"``, ``"16-mixed"``, ``32``) and Hugging Face style names."""
    if dtype is None:
        return None
    text = str(dtype).strip().lower()
    return _DTYPES.get(text)


@dataclass(frozen=True)
class RulesConfig:
    """What the rules need to know about the run.

    Args:
        dtype: the compute dtype (see :func:`normalize_dtype`); ``low_tensor_use`` judges only
            bf16/fp16 runs and stays quiet (no key) when it is unknown.
        gpus: the monitored GPUs (``RunContext.gpus``): total memory and power limit.
        distributed: rows hold one GPU per rank (rank 0's gathered rows); turns on
            ``slow_rank`` from GPM figures.  Rows with ``rank/{r}/cpu_busy_s`` keys turn it on
            too.
        min_steps: training steps before any rule may fire.
        min_rows: the least number of windows a rule's evidence holds.
        min_span_s: the least wall-clock time (s) the evidence of a rule on sampled GPU
            figures covers.
        disabled: names of rules to leave out.
    """

    dtype: str | None = None
    gpus: Sequence[GpuInfo] = ()
    distributed: bool = False
    min_steps: int = 20
    min_rows: int = 10
    min_span_s: float = 2.0
    disabled: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = set(self.disabled) - set(RULES)
        if unknown:
            raise ValueError(f"unknown rule(s) {sorted(unknown)}; known: {sorted(RULES)}")
        if self.min_steps < 0 or self.min_rows < 1 or self.min_span_s < 0:
            raise ValueError("min_steps >= 0, min_rows >= 1 and min_span_s >= 0 are required")


# -- levels and evidence ----------------------------------------------------------------------

FIRE = 1
CLEAR = -1
BETWEEN = 0


@dataclass
class _Obs:
    time: float
    step: int
    level: int
    figures: dict[str, float]
    force: bool = False
    """Fire at once (past the warm-up), whatever the share: a new OOM."""
    sampled: bool = True
    """From figures the sampler averages over the window (GPU activity, power, clocks): the
    evidence must also cover :attr:`RulesConfig.min_span_s`.  Figures measured exactly per
    step (step anatomy, CPU time, allocator counters and readings) need no span."""


@dataclass
class _Track:
    """Evidence and state of one (rule, subject)."""

    obs: deque[_Obs] = field(default_factory=deque)
    fire_n: int = 0
    clear_n: int = 0
    firing: bool = False
    last_time: float = -math.inf
    rows_since: int = 0

    def add(self, o: _Obs, min_rows: int, min_span_s: float, cap: int = 1024) -> None:
        self.obs.append(o)
        self.fire_n += o.level == FIRE
        self.clear_n += o.level == CLEAR
        self.last_time = o.time
        self.rows_since = 0
        while len(self.obs) > min_rows and (
            o.time - self.obs[1].time >= min_span_s or len(self.obs) > cap
        ):
            old = self.obs.popleft()
            self.fire_n -= old.level == FIRE
            self.clear_n -= old.level == CLEAR

    def full(self, min_rows: int, min_span_s: float) -> bool:
        return (len(self.obs) >= min_rows
                and self.obs[-1].time - self.obs[0].time >= min_span_s * 0.999)

    def medians(self, level: int | None = None) -> dict[str, float]:
        """Median of each figure over the evidence (only observations at ``level`` if given)."""
        seen: dict[str, list[float]] = {}
        for o in self.obs:
            if level is None or o.level == level:
                for k, v in o.figures.items():
                    seen.setdefault(k, []).append(v)
        return {k: statistics.median(v) for k, v in seen.items()}

    def reset(self) -> None:
        self.obs.clear()
        self.fire_n = self.clear_n = 0
        self.firing = False


@dataclass
class _RowView:
    """One row, split by subject."""

    step: int
    time: float
    steps: float
    gpus: dict[int, dict[str, float]]
    ranks: dict[int, dict[str, float]]
    scalars: dict[str, float]
    active: set[int]
    """GPUs seen in use by the job so far."""
    mem_total_gb: dict[int, float]
    power_limit_w: dict[int, float]
    levels: dict[str, dict[str, int]] = field(default_factory=dict)
    """Levels already observed in this row, by rule and subject (for suppression)."""


GPU_KEYS = frozenset({
    "util_pct", "sm_active_pct", "tensor_active_pct", "throttle_power_pct",
    "throttle_thermal_pct", "power_w", "power_limit_w", "mem_used_gb", "mem_used_gb_max",
    "mem_pct", "temp_c", "temp_c_max", "sm_clock_mhz", "torch_allocated_gb",
    "torch_alloc_retries", "torch_ooms",
})
"""The ``gpu/{i}/<suffix>`` keys the rules read (the others are not even parsed)."""
RANK_KEYS = frozenset({"cpu_busy_s"})
"""The ``rank/{r}/<suffix>`` keys the rules read."""


def _fmt(v: float, unit: str = "") -> str:
    if unit == "%":
        return f"{v:.0f} %" if abs(v) >= 10 else f"{v:.1f} %"
    if unit == "s":
        return f"{v:.3f} s" if v < 1 else f"{v:.2f} s"
    if unit == "GB":
        return f"{v:.2f} GB"
    if unit == "W":
        return f"{v:.0f} W"
    return f"{v:.2f}"


class _Rule:
    """A rule's observation of one row, and its words."""

    advice = ""

    def __init__(self, spec: RuleSpec, config: RulesConfig) -> None:
        self.spec = spec
        self.config = config

    def observe(self, view: _RowView) -> dict[str, _Obs]:
        raise NotImplementedError

    def label(self, subject: str) -> str:
        return {"job": "the job", "gpu": f"GPU {subject}", "rank": f"rank {subject}"}[
            self.spec.subject]

    def data(self, subject: str, figures: Mapping[str, float]) -> dict[str, float]:
        prefix = {"job": "", "gpu": f"gpu/{subject}/", "rank": f"rank/{subject}/"}[
            self.spec.subject]
        return {(k if "/" in k else prefix + k): v for k, v in figures.items()}

    summarised = "figures are medians"
    """How :meth:`summary` sums up the evidence (said at the end of a firing message)."""

    def summary(self, track: _Track, level: int | None) -> dict[str, float]:
        """The figures a message quotes: medians over the evidence (at ``level`` if given and
        any observation has it)."""
        return track.medians(level) or track.medians()

    def note(self, summaries: Mapping[str, Mapping[str, float]]) -> str:
        """A sentence said once per firing message, after every subject's part."""
        return ""

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        """What was seen, from :meth:`summary` of the evidence at fire level."""
        raise NotImplementedError

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        """What is seen now that the rule cleared, from the medians of the evidence."""
        raise NotImplementedError

    def level(self, checks: Iterable[tuple[Threshold, float]]) -> int:
        """FIRE when every check is at fire level, CLEAR when any is at clear level."""
        checks = list(checks)
        if any(t.at_clear(v) for t, v in checks):
            return CLEAR
        if all(t.at_fire(v) for t, v in checks):
            return FIRE
        return BETWEEN


def _finite(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


# -- the rules --------------------------------------------------------------------------------


class _InputBound(_Rule):
    advice = ("Feed the GPUs faster: more DataLoader workers (num_workers), pin_memory=True, "
              "persistent_workers=True and a larger prefetch_factor; move decoding, "
              "tokenisation and augmentation out of __getitem__ (pre-process and cache); check "
              "the storage's read rate.")

    def observe(self, view: _RowView) -> dict[str, _Obs]:
        s = self.spec
        wait = view.scalars.get("perf/data_wait_pct")
        if wait is not None:
            fig = {"perf/data_wait_pct": wait}
            for k in ("perf/data_wait_s", "perf/step_time_s"):
                if k in view.scalars:
                    fig[k] = view.scalars[k]
            lvl = self.level([(s.threshold("data_wait"), wait)])
            return {"job": _Obs(view.time, view.step, lvl, fig, sampled=False)}
        step_time = view.scalars.get("perf/step_time_s")
        utils = [g["util_pct"] for i, g in view.gpus.items()
                 if i in view.active and "util_pct" in g]
        if not utils:
            utils = [g["sm_active_pct"] for i, g in view.gpus.items()
                     if i in view.active and "sm_active_pct" in g]
        if step_time is None or not utils:
            return {}
        util = statistics.fmean(utils)
        idle_s = (1 - util / 100) * step_time
        fig = {"util_pct": util, "idle_s": idle_s, "perf/step_time_s": step_time}
        lvl = self.level([(s.threshold("gpu_util"), util), (s.threshold("idle_s"), idle_s)])
        return {"job": _Obs(view.time, view.step, lvl, fig)}

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        if "perf/data_wait_pct" in med:
            text = (f"the training step waited for its next batch "
                    f"{_fmt(med['perf/data_wait_pct'], '%')} of its time (perf/data_wait_pct)")
            if "perf/data_wait_s" in med and "perf/step_time_s" in med:
                text += (f": {_fmt(med['perf/data_wait_s'], 's')} of "
                         f"{_fmt(med['perf/step_time_s'], 's')} per step")
            return text
        return (f"the GPUs ran no kernel {_fmt(100 - med['util_pct'], '%')} of each step "
                f"(NVML utilization {_fmt(med['util_pct'], '%')}): "
                f"{_fmt(med['idle_s'], 's')} idle of {_fmt(med['perf/step_time_s'], 's')} per "
                f"step. This loop reports no perf/data_wait_pct, so the wait may also be other "
                f"host work between steps (logging, Python overhead)")

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        if "perf/data_wait_pct" in med:
            return f"data wait is down to {_fmt(med['perf/data_wait_pct'], '%')} of the step"
        if "util_pct" in med:
            return f"the GPUs are busy again (NVML utilization {_fmt(med['util_pct'], '%')})"
        return "no longer seen"


class _PowerCapped(_Rule):
    advice = ("The GPU works at its power limit and lowers its clocks to stay under it. If the "
              "limit was lowered (nvidia-smi -q -d POWER: Current vs Default Power Limit), "
              "raise it (nvidia-smi -pl); otherwise this is the card's ceiling: more work per "
              "step will not run faster, and energy per step is the figure to improve.")

    def observe(self, view: _RowView) -> dict[str, _Obs]:
        s, out = self.spec, {}
        for i, g in view.gpus.items():
            thr, power = g.get("throttle_power_pct"), g.get("power_w")
            limit = g.get("power_limit_w", view.power_limit_w.get(i))
            if thr is None or power is None or not limit:
                continue
            share = power / limit
            lvl = self.level([(s.threshold("throttle_power"), thr),
                              (s.threshold("power_share"), share)])
            out[str(i)] = _Obs(view.time, view.step, lvl, {
                "throttle_power_pct": thr, "power_w": power, "power_limit_w": limit})
        return out

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)} held its clocks down for the power cap "
                f"{_fmt(med['throttle_power_pct'], '%')} of the time, drawing "
                f"{_fmt(med['power_w'], 'W')} of its {_fmt(med['power_limit_w'], 'W')} limit")

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)} power-cap throttling "
                f"{_fmt(med.get('throttle_power_pct', 0.0), '%')} of the time, drawing "
                f"{_fmt(med.get('power_w', 0.0), 'W')}")


class _Thermal(_Rule):
    advice = ("Check cooling: airflow, blocked intakes, fans or chassis faults, the room's "
              "temperature. A GPU hotter than its neighbours under the same load may need "
              "service; nvidia-smi -q -d TEMPERATURE,PERFORMANCE shows its slowdown "
              "temperature.")

    def observe(self, view: _RowView) -> dict[str, _Obs]:
        t, out = self.spec.threshold("throttle_thermal"), {}
        for i, g in view.gpus.items():
            thr = g.get("throttle_thermal_pct")
            if thr is None:
                continue
            fig = {"throttle_thermal_pct": thr}
            for k in ("temp_c", "temp_c_max", "sm_clock_mhz"):
                if k in g:
                    fig[k] = g[k]
            out[str(i)] = _Obs(view.time, view.step, self.level([(t, thr)]), fig)
        return out

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        text = (f"{self.label(subject)} held its clocks down for temperature "
                f"{_fmt(med['throttle_thermal_pct'], '%')} of the time")
        extra = []
        if "temp_c" in med:
            extra.append(f"{med['temp_c']:.0f} °C")
        if "temp_c_max" in med:
            extra.append(f"peak {med['temp_c_max']:.0f} °C")
        if "sm_clock_mhz" in med:
            extra.append(f"SM clock {med['sm_clock_mhz']:.0f} MHz")
        return text + (f" ({', '.join(extra)})" if extra else "")

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)} thermal throttling "
                f"{_fmt(med.get('throttle_thermal_pct', 0.0), '%')} of the time")


class _LowTensor(_Rule):
    advice = ("Matrix products are not running on tensor cores: check that the forward pass "
              "runs under torch.autocast(dtype=torch.bfloat16) (or the model is cast), that "
              "matmul dimensions are multiples of 8 (16 for bf16/fp16 on Hopper), and that "
              "fp32 matmuls may use TF32 (torch.set_float32_matmul_precision('high')).")

    def observe(self, view: _RowView) -> dict[str, _Obs]:
        if normalize_dtype(self.config.dtype) not in ("bf16", "fp16"):
            return {}
        s, out = self.spec, {}
        for i, g in view.gpus.items():
            sm, tensor = g.get("sm_active_pct"), g.get("tensor_active_pct")
            if sm is None or tensor is None:
                continue
            share = tensor / sm if sm > 0 else 0.0
            lvl = self.level([(s.threshold("sm_busy"), sm), (s.threshold("tensor_share"), share)])
            out[str(i)] = _Obs(view.time, view.step, lvl,
                               {"sm_active_pct": sm, "tensor_active_pct": tensor})
        return out

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)} in a {normalize_dtype(self.config.dtype)} run: SMs "
                f"active {_fmt(med['sm_active_pct'], '%')} but tensor pipes only "
                f"{_fmt(med['tensor_active_pct'], '%')}")

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)} tensor pipes "
                f"{_fmt(med.get('tensor_active_pct', 0.0), '%')} with SMs "
                f"{_fmt(med.get('sm_active_pct', 0.0), '%')} active")


class _UnderUsed(_Rule):
    advice = ("Give the GPU more work per step: a larger (micro-)batch, sequence packing, "
              "torch.compile or CUDA graphs to cut kernel-launch overhead; if steps wait on "
              "the host, more DataLoader workers.")

    def observe(self, view: _RowView) -> dict[str, _Obs]:
        s, out = self.spec, {}
        suppressed = view.levels.get("input_bound", {}).get("job") == FIRE
        for i, g in view.gpus.items():
            if i not in view.active:
                continue
            if "sm_active_pct" in g:
                fig = {"sm_active_pct": g["sm_active_pct"]}
                lvl = self.level([(s.threshold("sm_active"), g["sm_active_pct"])])
            elif "util_pct" in g:
                fig = {"util_pct": g["util_pct"]}
                lvl = self.level([(s.threshold("util"), g["util_pct"])])
            else:
                continue
            if suppressed and lvl == FIRE:
                lvl = BETWEEN
            out[str(i)] = _Obs(view.time, view.step, lvl, fig)
        return out

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        if "sm_active_pct" in med:
            return (f"{self.label(subject)} had only {_fmt(med['sm_active_pct'], '%')} of its "
                    f"SMs busy (GPM SM activity)")
        return (f"{self.label(subject)} ran kernels only {_fmt(med['util_pct'], '%')} of the "
                f"time (NVML utilization)")

    def note(self, summaries: Mapping[str, Mapping[str, float]]) -> str:
        if any("util_pct" in m for m in summaries.values()):
            return ("Where a GPU reports no GPM SM activity, the rule reads NVML utilization, "
                    "which counts a GPU running any kernel as busy: the GPU may be emptier "
                    "than it says")
        return ""

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        if "sm_active_pct" in med:
            return f"{self.label(subject)} SM activity {_fmt(med['sm_active_pct'], '%')}"
        return f"{self.label(subject)} NVML utilization {_fmt(med.get('util_pct', 0.0), '%')}"


class _Headroom(_Rule):
    advice = ("The next longer batch may run out of memory: activation checkpointing, a "
              "smaller micro-batch with gradient accumulation, or "
              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to cut fragmentation.")

    def observe(self, view: _RowView) -> dict[str, _Obs]:
        t, out = self.spec.threshold("headroom"), {}
        for i, g in view.gpus.items():
            used = g.get("mem_used_gb_max", g.get("mem_used_gb"))
            total = view.mem_total_gb.get(i)
            if used is None or not total:
                continue
            headroom = 100 * (1 - used / total)
            out[str(i)] = _Obs(view.time, view.step, self.level([(t, headroom)]),
                               {"mem_used_gb_max": used, "mem_total_gb": total,
                                "headroom_pct": headroom})
        return out

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)} peaked at {_fmt(med['mem_used_gb_max'], 'GB')} of "
                f"{_fmt(med['mem_total_gb'], 'GB')}: {_fmt(med['headroom_pct'], '%')} left")

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return f"{self.label(subject)} has {_fmt(med.get('headroom_pct', 0.0), '%')} free"


class _Retries(_Rule):
    advice = ("The caching allocator could not find memory: each retry frees its cache and "
              "synchronises the device. Reduce the (micro-)batch or sequence length, set "
              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, and avoid shapes that change "
              "every step.")

    def __init__(self, spec: RuleSpec, config: RulesConfig) -> None:
        super().__init__(spec, config)
        self._last: dict[tuple[int, str], float] = {}

    def _new(self, i: int, key: str, value: float | None) -> float | None:
        if value is None:
            return None
        prev = self._last.get((i, key))
        self._last[(i, key)] = value
        if prev is None:
            return 0.0
        return value - prev if value >= prev else value  # a reset counter restarts from 0

    def observe(self, view: _RowView) -> dict[str, _Obs]:
        t, out = self.spec.threshold("new_events"), {}
        for i, g in view.gpus.items():
            retries = self._new(i, "torch_alloc_retries", g.get("torch_alloc_retries"))
            ooms = self._new(i, "torch_ooms", g.get("torch_ooms"))
            if retries is None and ooms is None:
                continue
            new = (retries or 0.0) + (ooms or 0.0)
            fig = {"new_retries": retries or 0.0, "new_ooms": ooms or 0.0}
            for k in ("torch_alloc_retries", "torch_ooms"):
                if k in g:
                    fig[k] = g[k]
            out[str(i)] = _Obs(view.time, view.step, FIRE if t.at_fire(new) else CLEAR, fig,
                               force=bool(ooms), sampled=False)
        return out

    summarised = "counts are totals"

    def summary(self, track: _Track, level: int | None) -> dict[str, float]:
        fired = [o for o in track.obs if o.level == FIRE]
        return {
            "windows_with_events": float(len(fired)),
            "windows": float(len(track.obs)),
            "new_retries": sum(o.figures.get("new_retries", 0.0) for o in track.obs),
            "new_ooms": sum(o.figures.get("new_ooms", 0.0) for o in track.obs),
        }

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        parts = []
        if med.get("new_ooms"):
            parts.append(f"{med['new_ooms']:.0f} out-of-memory error(s)")
        if med.get("new_retries"):
            parts.append(f"{med['new_retries']:.0f} allocation retries")
        return (f"{self.label(subject)}: the torch allocator counted "
                f"{' and '.join(parts) or 'retries'} (torch.cuda.memory_stats)")

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)}: no allocator retries or OOMs in the last "
                f"{med.get('windows', 0):.0f} windows")


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Robust slope (median of pairwise slopes) and the share of pairs (with distinct x) whose
    y rises along x (ties count half)."""
    n = len(xs)
    slopes = sorted([(ys[b] - ys[a]) / (xs[b] - xs[a])
                     for a in range(n) for b in range(a + 1, n) if xs[b] != xs[a]])
    if not slopes:
        return 0.0, 0.5
    m = len(slopes)
    median = slopes[m // 2] if m % 2 else (slopes[m // 2 - 1] + slopes[m // 2]) / 2
    below, above = bisect.bisect_left(slopes, 0.0), bisect.bisect_right(slopes, 0.0)
    return median, ((m - above) + 0.5 * (above - below)) / m


class _Creep(_Rule):
    advice = ("Something keeps tensors alive across steps: a loss summed without .item() or "
              ".detach(), outputs appended to a list, a cache that only grows. Check what "
              "the loop keeps between steps.")

    def __init__(self, spec: RuleSpec, config: RulesConfig) -> None:
        super().__init__(spec, config)
        self._readings: dict[int, deque[tuple[float, float]]] = {}
        self._read_at: dict[int, float] = {}

    def observe(self, view: _RowView) -> dict[str, _Obs]:
        s, out = self.spec, {}
        for i, g in view.gpus.items():
            alloc = g.get("torch_allocated_gb")
            total = view.mem_total_gb.get(i)
            if alloc is None or not total:
                continue
            r = self._readings.setdefault(i, deque(maxlen=CREEP_READINGS))
            if r and r[-1][0] >= view.step:
                r.clear()  # the step went back: a new phase, a new baseline
            last_t = self._read_at.get(i, -math.inf)
            if r and alloc == r[-1][1] and view.time - last_t < READING_GAP_S:
                continue  # the same reading carried into another window: not a new one
            self._read_at[i] = view.time
            r.append((float(view.step), alloc))
            if len(r) < CREEP_READINGS // 2:
                continue
            xs, ys = [p[0] for p in r], [p[1] for p in r]
            slope, rising = theil_sen(xs, ys)
            growth_gb = slope * (xs[-1] - xs[0])
            growth = 100 * growth_gb / total
            lvl = self.level([(s.threshold("growth"), growth),
                              (s.threshold("rising"), 100 * rising)])
            used = max(max(ys), g.get("mem_used_gb_max", g.get("mem_used_gb", 0.0)))
            free = total - used  # what the device has left (NVML), not only the allocator
            out[str(i)] = _Obs(view.time, view.step, lvl, sampled=False, figures={
                "torch_allocated_gb": alloc, "first_gb": ys[0], "first_step": xs[0],
                "slope_gb_per_step": slope, "growth_gb": growth_gb, "growth_pct": growth,
                "rising_pct": 100 * rising, "free_gb": free})
        return out

    summarised = "figures are the latest fit"

    def summary(self, track: _Track, level: int | None) -> dict[str, float]:
        return dict(track.obs[-1].figures) if track.obs else {}

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        slope = med["slope_gb_per_step"]
        text = (f"{self.label(subject)}: torch_allocated_gb grew from "
                f"{_fmt(med['first_gb'], 'GB')} at step {med['first_step']:.0f} to "
                f"{_fmt(med['torch_allocated_gb'], 'GB')}, {slope * 1000:.1f} MB per step "
                f"(robust slope over the last {CREEP_READINGS} readings; "
                f"{med['rising_pct']:.0f} % of reading pairs rising)")
        if slope > 0 and med.get("free_gb", 0) > 0:
            text += (f"; at this rate the {_fmt(med['free_gb'], 'GB')} of device memory "
                     f"still free last "
                     f"~{med['free_gb'] / slope:.0f} more steps")
        return text

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"{self.label(subject)}: torch_allocated_gb is flat again "
                f"({med.get('slope_gb_per_step', 0.0) * 1000:.1f} MB per step)")


class _SlowRank(_Rule):
    advice = ("The slowest rank sets the pace: every other rank waits for it at each gradient "
              "all-reduce. Check that rank's GPU (thermal or power throttling, clocks), its host "
              "(CPU contention, NUMA binding, other processes) and uneven work (shards with "
              "longer sequences: packing or length-balanced sampling).")

    def __init__(self, spec: RuleSpec, config: RulesConfig) -> None:
        super().__init__(spec, config)
        self.basis = ""
        self.sampled = True
        self._spikes: dict[int, tuple[int, float, dict[str, float], int]] = {}
        """rank -> (step, time, figures, windows seen since) of a spike awaiting confirmation"""
        self._last_notice: dict[int, int] = {}

    def busy(self, view: _RowView) -> tuple[dict[int, float], str] | None:
        step_time = view.scalars.get("perf/step_time_s")
        if (self.config.distributed and step_time is not None and len(view.gpus) >= 2
                and all("sm_active_pct" in g for g in view.gpus.values())):
            self.sampled = True
            return ({i: g["sm_active_pct"] / 100 * step_time for i, g in view.gpus.items()},
                    "GPU busy time per step (GPM sm_active_pct x perf/step_time_s)")
        cpu = {r: v["cpu_busy_s"] for r, v in view.ranks.items() if "cpu_busy_s" in v}
        if len(cpu) >= 2:
            self.sampled = False
            return cpu, "CPU time of the training thread per step (rank/{r}/cpu_busy_s)"
        return None

    def observe(self, view: _RowView) -> dict[str, _Obs]:
        got = self.busy(view)
        if got is None:
            return {}
        busy, self.basis = got
        lag_t = self.spec.threshold("lag" if self.sampled else "lag_cpu")
        out: dict[str, _Obs] = {}
        for r, b in busy.items():
            others = [v for k, v in busy.items() if k != r]
            ref = statistics.median(others)
            if ref <= 0:
                continue
            lag = 100 * (b / ref - 1)
            out[str(r)] = _Obs(view.time, view.step, self.level([(lag_t, lag)]),
                               {"busy_s": b, "others_busy_s": ref, "lag_pct": lag},
                               sampled=self.sampled)
        return out

    def saw(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"rank {subject} is chronically slow (most recent windows, not a one-off): busy "
                f"{_fmt(med['busy_s'], 's')} per step, {_fmt(med['lag_pct'], '%')} more than "
                f"the median of the other ranks ({_fmt(med['others_busy_s'], 's')}), measured "
                f"as {self.basis}")

    def cleared(self, subject: str, med: Mapping[str, float]) -> str:
        return (f"rank {subject} keeps pace again ({_fmt(med.get('lag_pct', 0.0), '%')} above "
                f"the median of the others)")

    def one_offs(self, view: _RowView, tracks: Mapping[str, _Track],
                 observed: Mapping[str, _Obs], warm: bool) -> list[Event]:
        """Spikes (one window far above the others) that the next windows did not repeat."""
        spike_t = self.spec.threshold("one_off")
        events: list[Event] = []
        for subject, o in observed.items():
            r = int(subject)
            pending = self._spikes.get(r)
            if pending is not None:
                step, t, fig, n = pending
                if not spike_t.at_clear(o.figures["lag_pct"]) or tracks[subject].firing:
                    del self._spikes[r]  # not a one-off: it goes on (the alert tells it)
                    continue
                n += 1
                if n < ONE_OFF_CONFIRM_ROWS:
                    self._spikes[r] = (step, t, fig, n)
                    continue
                del self._spikes[r]
                if step - self._last_notice.get(r, -(10**12)) < ONE_OFF_GAP_STEPS:
                    continue
                self._last_notice[r] = step
                events.append(Event(
                    kind="notice", name=self.spec.name, state="info", step=view.step,
                    time=view.time,
                    severity="info",
                    message=(f"rank {r} lagged once at step {step}: busy "
                             f"{_fmt(fig['busy_s'], 's')}, {_fmt(fig['lag_pct'], '%')} more "
                             f"than the median of the other ranks "
                             f"({_fmt(fig['others_busy_s'], 's')}); the "
                             f"{ONE_OFF_CONFIRM_ROWS} windows since kept pace: a one-off "
                             f"({self.basis})"),
                    advice=("A one-off lag is usually a hiccup of that rank's host (garbage "
                            "collection, a checkpoint write, another process); repeated ones "
                            "are worth a look at that host."),
                    data={"rank": float(r), "spike_step": float(step),
                          **{f"rank/{r}/{k}": v for k, v in fig.items()}},
                ))
            elif warm and spike_t.at_fire(o.figures["lag_pct"]) and not tracks[subject].firing:
                self._spikes[r] = (o.step, o.time, dict(o.figures), 0)
        return events


_RULE_CLASSES: dict[str, type[_Rule]] = {
    "input_bound": _InputBound,
    "power_capped": _PowerCapped,
    "thermal": _Thermal,
    "low_tensor_use": _LowTensor,
    "under_used": _UnderUsed,
    "memory_headroom": _Headroom,
    "memory_alloc_retries": _Retries,
    "memory_creep": _Creep,
    "slow_rank": _SlowRank,
}


# -- the engine -------------------------------------------------------------------------------


class RuleEngine:
    """Runs the rules of :data:`RULES` on finished rows (see the module docstring).

    Not thread-safe: feed it from one thread, in step order.  Cost: a few tens of microseconds
    of Python per row and GPU (``benchmarks/rules_cost.py``).
    """

    def __init__(self, config: RulesConfig | None = None) -> None:
        self.config = config or RulesConfig()
        self._rules: list[_Rule] = [
            cls(RULES[name], self.config) for name, cls in _RULE_CLASSES.items()
            if name not in self.config.disabled
        ]
        self._tracks: dict[str, dict[str, _Track]] = {r.spec.name: {} for r in self._rules}
        self._judged: set[str] = set()
        self._firing: dict[str, set[str]] = {r.spec.name: set() for r in self._rules}
        self._start_step: int | None = None
        self._active: set[int] = set()
        self._mem_total = {g.index: g.mem_total_gb for g in self.config.gpus if g.mem_total_gb}
        self._power_limit = {g.index: g.power_limit_w for g in self.config.gpus
                             if g.power_limit_w}
        self._keys: dict[str, tuple[str, int, str] | None] = {}

    @property
    def rules(self) -> tuple[str, ...]:
        """Names of the rules this engine runs (those not disabled, nor switched off by a
        fault)."""
        return tuple(r.spec.name for r in self._rules)

    def firing(self) -> dict[str, tuple[str, ...]]:
        """The subjects each rule fires for now (rules firing for none are left out)."""
        return {k: tuple(sorted(v)) for k, v in self._firing.items() if v}

    def alert_keys(self) -> dict[str, float]:
        """``alerts/<rule>``: 1.0 while the rule fires for some subject, 0.0 while it does not;
        absent for a rule that has never had its inputs (or was switched off by a fault)."""
        return {f"alerts/{name}": 1.0 if self._firing.get(name) else 0.0
                for name in self.rules if name in self._judged}

    def feed(self, row_values: Mapping[str, float], step: int, time: float) -> list[Event]:
        """Judge one finished row (``step``: its training step; ``time``: Unix time at the end
        of its window) and return the events it causes, in rule order."""
        try:
            view = self._view(row_values, step, time)
        except Exception as e:  # a row the rules cannot read must not stop the engine
            warn_once("rules:row", "gpulens: advice rules skipped a row they could not read "
                      "(%s: %s); said once", type(e).__name__, e)
            return []
        if self._start_step is None:
            steps = int(view.steps) if view.steps >= 1 else 1
            self._start_step = step - steps
        warm = step - self._start_step >= self.config.min_steps
        events: list[Event] = []
        for rule in list(self._rules):
            try:
                events.extend(self._run(rule, view, warm))
            except Exception as e:  # a rule must never stop the engine
                name = rule.spec.name
                warn_once(f"rules:{name}",
                          "gpulens: advice rule %r failed and is switched off for this run "
                          "(%s: %s)", name, type(e).__name__, e)
                self._rules.remove(rule)
                self._firing.pop(name, None)
                self._judged.discard(name)
        return events

    # -- internals --------------------------------------------------------------------------

    def _view(self, values: Mapping[str, float], step: int, time: float) -> _RowView:
        gpus: dict[int, dict[str, float]] = {}
        ranks: dict[int, dict[str, float]] = {}
        scalars: dict[str, float] = {}
        cache = self._keys
        for key, raw in values.items():
            parsed = cache.get(key, _UNSEEN)
            if parsed is _UNSEEN:
                parsed = _parse_key(key)
                if len(cache) < 65536:  # keys repeat row after row; bounded all the same
                    cache[key] = parsed
            if parsed is None:
                continue
            v = raw if type(raw) is float and math.isfinite(raw) else _finite(raw)
            if v is None:
                continue
            kind, index, suffix = parsed
            if kind == "gpu":
                gpus.setdefault(index, {})[suffix] = v
            elif kind == "rank":
                ranks.setdefault(index, {})[suffix] = v
            else:
                scalars[key] = v
        mem_total = dict(self._mem_total)
        for i, g in gpus.items():
            if (i not in mem_total and g.get("mem_pct", 0) > 0 and "mem_used_gb" in g):
                mem_total[i] = g["mem_used_gb"] * 100 / g["mem_pct"]
            if (max(g.get("sm_active_pct", 0.0), g.get("util_pct", 0.0)) >= ACTIVE_PCT
                    or "torch_allocated_gb" in g):
                self._active.add(i)
        return _RowView(step=step, time=time, steps=scalars.get("perf/steps", 1.0), gpus=gpus,
                        ranks=ranks, scalars=scalars, active=self._active,
                        mem_total_gb=mem_total, power_limit_w=self._power_limit)

    def _run(self, rule: _Rule, view: _RowView, warm: bool) -> list[Event]:
        spec, cfg = rule.spec, self.config
        tracks = self._tracks[spec.name]
        observed = rule.observe(view)
        if observed:
            self._judged.add(spec.name)
        view.levels[spec.name] = {s: o.level for s, o in observed.items()}
        newly: list[str] = []
        cleared: dict[str, str] = {}
        for subject, o in observed.items():
            track = tracks.setdefault(subject, _Track())
            span = cfg.min_span_s if o.sampled else 0.0
            track.add(o, cfg.min_rows, span)
            full = track.full(cfg.min_rows, span)
            if not track.firing:
                if warm and ((o.force and o.level == FIRE) or (
                        full and track.fire_n >= spec.fire_share * len(track.obs))):
                    track.firing = True
                    newly.append(subject)
            elif full and track.clear_n >= spec.clear_share * len(track.obs):
                track.firing = False
                cleared[subject] = rule.cleared(subject, rule.summary(track, None))
        for subject, track in tracks.items():
            if subject in observed:
                continue
            track.rows_since += 1
            if (track.rows_since >= STALE_ROWS and view.time - track.last_time >= STALE_S
                    and track.obs):
                if track.firing:
                    cleared[subject] = (f"{rule.label(subject)}: no longer measured since step "
                                        f"{track.obs[-1].step}")
                track.reset()
        events: list[Event] = []
        if isinstance(rule, _SlowRank):
            events.extend(rule.one_offs(view, tracks, observed, warm))
        firing = self._firing[spec.name]
        if newly:
            firing.update(newly)
            events.append(self._fire_event(rule, view, newly, tracks))
        if cleared:
            firing.difference_update(cleared)
            if not firing:
                events.append(Event(
                    kind="alert", name=spec.name, state="resolved", step=view.step,
                    time=view.time, severity=spec.severity,
                    message=f"{spec.title}: resolved at step {view.step}. "
                            + "; ".join(cleared[s] for s in sorted(cleared, key=_order)) + ".",
                    data={},
                ))
        return events

    def _fire_event(self, rule: _Rule, view: _RowView, newly: list[str],
                    tracks: Mapping[str, _Track]) -> Event:
        spec = rule.spec
        firing = sorted(self._firing[spec.name], key=_order)
        parts, data, summaries = [], {}, {}
        for subject in sorted(newly, key=_order):
            track = tracks[subject]
            med = summaries[subject] = rule.summary(track, FIRE)
            parts.append(rule.saw(subject, med))
            data.update(rule.data(subject, {k: round(v, 6) for k, v in med.items()}))
            if spec.subject == "rank":
                data["rank"] = float(subject)
        first, last = newly_span(tracks, newly)
        n_fire = sum(tracks[s].fire_n for s in newly)
        n_all = sum(len(tracks[s].obs) for s in newly)
        also = [s for s in firing if s not in newly]
        message = (f"{spec.title}: " + "; ".join(parts)
                   + f" (windows of steps {first}-{last}: {n_fire} of {n_all} past the "
                     f"threshold; {rule.summarised})")
        if also:
            message += "; already firing for " + ", ".join(rule.label(s) for s in also)
        note = rule.note(summaries)
        message += "." + (f" {note}." if note else "")
        return Event(kind="alert", name=spec.name, state="firing", step=view.step,
                     time=view.time, severity=spec.severity, message=message,
                     advice=rule.advice, data=data)


_UNSEEN: tuple[str, int, str] = ("", -1, "")


def _parse_key(key: str) -> tuple[str, int, str] | None:
    """``("gpu", i, suffix)``, ``("rank", r, suffix)``, ``("perf", 0, key)`` for a key some
    rule reads; ``None`` for the others (``gpu/all/...``, ``train/...``, ...)."""
    head, _, rest = key.partition("/")
    if head == "perf":
        return ("perf", 0, key)
    if head not in ("gpu", "rank"):
        return None
    index, _, suffix = rest.partition("/")
    if suffix not in (GPU_KEYS if head == "gpu" else RANK_KEYS) or not index.isdigit():
        return None
    return (head, int(index), suffix)


def newly_span(tracks: Mapping[str, _Track], subjects: Sequence[str]) -> tuple[int, int]:
    """First and last step of the evidence of ``subjects``."""
    firsts = [tracks[s].obs[0].step for s in subjects if tracks[s].obs]
    lasts = [tracks[s].obs[-1].step for s in subjects if tracks[s].obs]
    return (min(firsts), max(lasts)) if firsts else (0, 0)


def _order(subject: str) -> tuple[int, str]:
    return (int(subject), "") if subject.isdigit() else (-1, subject)


def rules_table() -> str:
    """A Markdown table of every rule and threshold (for docs), built from :data:`RULES`."""
    lines = ["| rule | subject | severity | threshold | compares | fires | clears | evidence |",
             "|---|---|---|---|---|---|---|---|"]
    for spec in RULES.values():
        for t in spec.thresholds:
            clear_op = "<" if t.op == ">=" else ">"
            unit = f" {t.unit}" if t.unit and t.unit not in ("count",) else ""
            lines.append(
                f"| {spec.name} | {spec.subject} | {spec.severity} | {t.name} | "
                f"{t.quantity} | {t.op} {t.fire:g}{unit} | {clear_op} {t.clear:g}{unit} | "
                f"fire {spec.fire_share:.0%}, clear {spec.clear_share:.0%} |")
    return "\n".join(lines)
