"""Finishing a row: throughput, achieved TFLOP/s and MFU from the work the client reported,
then the advice rules.  Runs in the engine (off the training process's GIL), on every row in
step order: the sampler thread's own rows, or a distributed job's merged rows.

What a finished row gains (each absent where its inputs are):

* ``perf/tokens_per_s`` / ``perf/samples_per_s``, ``perf/tokens_per_j`` /
  ``perf/samples_per_j``, ``perf/tflops`` (achieved, per GPU), ``perf/tflops_job``,
  ``perf/mfu_pct``, ``perf/mfu_clock_adjusted_pct``, ``perf/mfu_when_tensor_active_pct``
  (:func:`gpulens.work.mfu.window_perf`; the peak is the GPU's dense figure in the run's dtype,
  :func:`gpulens.work.peaks.peak_for`, recorded in the run's metadata);
* ``rank/{r}/cpu_busy_s`` in a distributed job: CPU seconds each rank's training thread (the
  one that calls ``log()``) used per step, which the slow-rank rule compares;
* ``alerts/<rule>`` (1 firing, 0 not) and the rules' events (:mod:`gpulens.engine.rules`); a
  rule that fires is also a WARNING through the ``gpulens`` logger, with what to try.  The rules
  judge every row while judging stays within :data:`RULES_CPU_SHARE` of one core (a token
  bucket: the CPU time judging took is measured, credit accrues at that share of wall-clock
  time and holds at most :data:`RULES_BURST_S`).  Judging a row costs ~80 us of CPU for 1 GPU
  and ~0.3 ms for 8 (``python benchmarks/rules_cost.py``), so a loop logging up to ~250 rows/s
  of 1 GPU, or ~75 of 8, is judged on every row; a loop logging a thousand times a second is
  judged on as many rows as the share pays for, and the alert keys of the rows in between say
  the rules' state.

The work figures a mark carried (``work/*``) and the sampler's ``work/gpm_from_start`` are
left out of the finished row; a row with the latter gets no ``perf/mfu_when_tensor_active_pct``
(:data:`gpulens.engine.spec.GPM_FROM_START`).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence

from gpulens.engine.rules import RULES, RuleEngine, RulesConfig
from gpulens.engine.spec import (
    GPM_FROM_START,
    WORK_FLOPS,
    WORK_KEYS,
    WORK_SAMPLES,
    WORK_TOKENS,
    EngineSpec,
)
from gpulens.log import logger
from gpulens.model import Event, GpuInfo, Row
from gpulens.schema import STEP_KEY

_GPU = re.compile(r"^gpu/(\d+)/(sm_clock_mhz|energy_j|tensor_active_pct)$")
RULES_CPU_SHARE = 0.02
"""Share of one CPU core the advice rules may spend judging rows, over the run."""
RULES_BURST_S = 0.1
"""CPU seconds of judging the rules may spend ahead of their share (the bucket's depth)."""


class Finisher:
    """Finishes the rows of one run (see the module doc)."""

    def __init__(self, spec: EngineSpec, gpus: Sequence[GpuInfo]) -> None:
        self.spec = spec
        self.meta: dict[str, str | float] = {}
        self.peak_tflops: float | None = None
        self.max_clock_mhz: float | None = None
        if spec.dtype is not None:
            self.meta["dtype"] = spec.dtype
        if spec.flops_per_token is not None:
            self.meta["flops_per_token"] = spec.flops_per_token
        if spec.flops_per_sample is not None:
            self.meta["flops_per_sample"] = spec.flops_per_sample
        if gpus and spec.dtype is not None:
            from gpulens.work.peaks import peak_for

            peaks = [peak_for(g.name, spec.dtype, memory_gb=g.mem_total_gb,
                              power_limit_w=g.default_power_limit_w or g.power_limit_w)
                     for g in gpus]
            if all(p is not None for p in peaks):
                found = [p for p in peaks if p is not None]
                self.peak_tflops = sum(p.tflops for p in found) / len(found)
                self.meta.update(found[0].describe())
                if len({p.gpu for p in found}) > 1:  # mixed cards: the mean peak
                    self.meta["peak_gpu"] = ", ".join(sorted({p.gpu for p in found}))
                    self.meta["peak_tflops"] = self.peak_tflops
        clocks = [g.max_sm_clock_mhz for g in gpus if g.max_sm_clock_mhz]
        if clocks:
            self.max_clock_mhz = min(clocks)
        self._tensor_ratio_out: list[float] = []
        self._tensor_ratio_told = False
        self._kinds: dict[str, tuple[str, str] | None] = {}
        """Each row key's (GPU, figure) where the work figures need it; ``None`` otherwise."""
        self._credit_s = RULES_BURST_S
        """CPU seconds the rules may spend now (see :data:`RULES_CPU_SHARE`)."""
        self._credit_at = time.perf_counter()
        try:
            self.rules: RuleEngine | None = RuleEngine(RulesConfig(
                dtype=spec.dtype, gpus=tuple(gpus), job=spec.job, distributed=spec.distributed,
                training=not spec.wall_clock))
        except Exception as exc:  # the rules are advice: never a reason not to monitor
            logger.warning("gpulens: the advice rules could not start (%r); rows go on "
                           "without them", exc)
            self.rules = None

    def finish(self, row: Row) -> Row:
        values = dict(row.values)
        if self.spec.wall_clock:  # ticks of a clock: no step, so no per-step figure
            for key in [k for k in values if k.startswith("perf/") or k == STEP_KEY]:
                del values[key]
        work = {k: values.pop(k) for k in WORK_KEYS if k in values}
        from_start = values.pop(GPM_FROM_START, 0.0)  # GPM spans that hold the start
        steps = values.get("perf/steps", 1.0) or 1.0
        step_time = values.get("perf/step_time_s")
        clocks: list[float] = []
        tensors: list[float] = []
        energy: float = 0.0
        have_energy = False
        gpus: set[str] = set()
        kinds = self._kinds
        for key, value in values.items():
            if key in kinds:
                found = kinds[key]
            else:
                m = _GPU.match(key) if key.startswith("gpu/") else None
                found = kinds[key] = (m.group(1), m.group(2)) if m is not None else None
            if found is None or not math.isfinite(value):
                continue
            gpus.add(found[0])
            kind = found[1]
            if kind == "sm_clock_mhz":
                clocks.append(value)
            elif kind == "tensor_active_pct":
                tensors.append(value)
            elif kind == "energy_j":
                energy += value
                have_energy = True
        n_gpus = len(gpus)
        job_gpus = values.get("job/gpus")
        if job_gpus is not None and job_gpus > n_gpus:
            # a distributed job's row holds one node's GPUs at most: the job's from aggregates
            n_gpus = int(job_gpus)
            clocks = _one(values, "gpu/all/sm_clock_mhz_mean")
            tensors = _one(values, "gpu/all/tensor_active_pct_mean")
            energy = values.get("gpu/all/energy_j_sum", math.nan)
            have_energy = math.isfinite(energy)
        if step_time is not None and any(k in work for k in
                                         (WORK_TOKENS, WORK_SAMPLES, WORK_FLOPS)):
            from gpulens.work.mfu import window_perf

            values.update(window_perf(
                seconds=step_time * steps, gpus=max(1, n_gpus),
                tokens=work.get(WORK_TOKENS), samples=work.get(WORK_SAMPLES), steps=steps,
                flops=work.get(WORK_FLOPS), flops_per_token=self.spec.flops_per_token,
                flops_per_sample=self.spec.flops_per_sample,
                peak_tflops=self.peak_tflops if gpus else None,
                mean_sm_clock_mhz=sum(clocks) / len(clocks) if clocks else None,
                max_sm_clock_mhz=self.max_clock_mhz,
                energy_j=energy if have_energy else None,
                tensor_active_pct=(sum(tensors) / len(tensors)
                                   if tensors and not from_start else None),
                dtype=self.spec.dtype, out_of_range=self._tensor_ratio_out,
            ))
            if self._tensor_ratio_out and not self._tensor_ratio_told:
                self._tensor_ratio_told = True
                logger.warning(
                    "gpulens: perf/mfu_when_tensor_active_pct is left out of the rows where it "
                    "would exceed 100 %% (step %d: %.0f %%): the FLOPs counted, the peak and GPM's "
                    "tensor activity disagree (FLOPs that ran off the tensor cores, a wrong GPU "
                    "variant, a window GPM does not cover); MFU itself is still written",
                    row.step, self._tensor_ratio_out[0])
            self._tensor_ratio_out.clear()
        events: list[Event] = []
        if self.rules is not None:
            now = time.perf_counter()
            self._credit_s = min(RULES_BURST_S,
                                 self._credit_s + (now - self._credit_at) * RULES_CPU_SHARE)
            self._credit_at = now
            if self._credit_s > 0.0:
                cpu = time.thread_time()
                events = self.rules.feed(values, row.step, row.time)
                self._credit_s -= time.thread_time() - cpu
            values.update(self.rules.alert_keys())
            for event in events:
                _tell(event)
        return Row(step=row.step, time=row.time, values=values,
                   events=row.events + tuple(events))


def _one(values: dict[str, float], key: str) -> list[float]:
    value = values.get(key)
    return [value] if value is not None and math.isfinite(value) else []


def _tell(event: Event) -> None:
    """A rule's event, as the user hears it through the ``gpulens`` logger: a rule that fires
    is one WARNING line (its title, and where the rest is); what it saw and what to try follow
    at INFO, and are in the rows' events (the dashboard, the report, the JSONL record)."""
    if event.kind == "alert" and event.state == "firing":
        spec = RULES.get(event.name)
        title = spec.title if spec is not None else event.message.split(". ", 1)[0]
        logger.warning("gpulens: %s at step %d: %s (alerts/%s; the dashboard and gpulens "
                       "report say what was seen and what to try)", event.name, event.step,
                       title, event.name)
        logger.info("gpulens: %s at step %d: %s%s", event.name, event.step, event.message,
                    f" Try: {event.advice}" if event.advice else "")
    else:
        logger.info("gpulens: %s %s at step %d: %s", event.name, event.state, event.step,
                    event.message)
