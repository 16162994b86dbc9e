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

Training rows and wall-clock rows.  Most rules judge training steps (:attr:`RuleSpec.training`):
their evidence (step time, step anatomy, the allocator) or their advice (batch size, loaders)
is about a training loop.  Rows that are ticks of a clock (``gpulens record`` and ``serve``:
``Monitor(wall_clock=True)``, :attr:`RulesConfig.training` ``False``) hold no training step,
so only ``power_capped`` and ``thermal``, facts of the hardware, judge them: a clock tick taken
for a step made an idle GPU look "input-bound".

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
Each rule is a module of this package (``thermal.py`` ...) holding its spec, thresholds
included, beside its code; :data:`RULES` gathers the specs (one table;
``integrations/prometheus/gpulens-rules.yml`` is checked against it by
``tests/test_rules_prometheus.py``).  Subjects: ``job``, ``gpu``
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
slow_rank              rank     busy time per step >= 20 % above the typical rank's (< 10 %):
                                the median of the other ranks, or over several nodes the
                                median of the nodes' medians; from CPU time (no GPM) >= 50 %
                                (< 25 %); a node whose fastest rank lags the other nodes'
                                fastest as much is named as the node (its ranks are not named
                                apart); the words say a GPU (GPM basis) or a rank (CPU time),
                                with its node; a single window >= 50 % above, with the next 3
                                windows < 20 %, is told once as a one-off notice
comm_bound             job      SM activity (mean of the job's GPUs) <= 50 % (> 60 %) and
                                NVLink (else PCIe) rx + tx per GPU >= 50 % of the run's busiest
                                window (< 30 %); windows under 1 GB/s are not judged
=====================  =======  ==============================================================

Keys read, per GPU ``i`` (``gpu/{i}/<suffix>``): ``util_pct``, ``sm_active_pct``,
``tensor_active_pct`` (GPM), ``throttle_power_pct``, ``throttle_thermal_pct``, ``power_w``,
``power_limit_w`` (else :attr:`GpuInfo.power_limit_w`), ``mem_used_gb_max`` (else
``mem_used_gb``), ``mem_pct`` (total memory where :attr:`GpuInfo.mem_total_gb` is unknown:
``mem_used_gb * 100 / mem_pct``), ``temp_c``, ``temp_c_max``, ``sm_clock_mhz``,
``torch_allocated_gb`` (the sampler carries one allocator reading, about one a second, into
the windows until the next: an unchanged value within 1 s is not a new reading) and the
allocator's two counters, read with it (:mod:`gpulens.sources.torch_alloc`):

* ``gpu/{i}/torch_alloc_retries``: ``torch.cuda.memory_stats()["num_alloc_retries"]``, the
  cumulative count (the rule takes differences; a count that goes down starts a new baseline);
* ``gpu/{i}/torch_ooms``: ``torch.cuda.memory_stats()["num_ooms"]``, cumulative likewise.

Job keys: ``perf/data_wait_pct`` (``perf/data_wait_s`` for the message), ``perf/step_time_s``,
``perf/steps``.  Per rank ``r`` of a distributed job (rank 0's row holds every rank):

* ``rank/{r}/cpu_busy_s``: CPU seconds of rank ``r``'s training thread per step in the window
  (the rank gather of :mod:`gpulens.distributed` adds it).  Busy time per step is
  ``gpu/{r}/sm_active_pct / 100 * perf/step_time_s`` where every rank's GPU reports GPM, else
  ``rank/{r}/cpu_busy_s``: on a CPU-only DDP job the all-reduce makes wall-clock phases equal on
  every rank, but a rank slow in backward compute burns more CPU while the others wait.

A GPU is judged by ``under_used`` and the GPU-idle branch of ``input_bound`` only once it has
been seen in use (SM activity or NVML utilization >= 5 % in some window, or a
``torch_allocated_gb`` reading): the idle GPUs of a node that the job does not train on are not
"under-used".
"""

from gpulens.engine.rules.catalog import RULE_CLASSES, RULES, rules_table
from gpulens.engine.rules.config import RulesConfig
from gpulens.engine.rules.creep import theil_sen
from gpulens.engine.rules.engine import ACTIVE_PCT, RuleEngine
from gpulens.engine.rules.spec import RuleSpec, Threshold

__all__ = [
    "ACTIVE_PCT",
    "RULES",
    "RULE_CLASSES",
    "RuleEngine",
    "RuleSpec",
    "RulesConfig",
    "Threshold",
    "rules_table",
    "theil_sen",
]
