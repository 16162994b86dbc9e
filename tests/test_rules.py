"""The advice/alert rule engine on synthetic row streams shaped like real rows.

The rows below copy the shape of what a ``Monitor`` on simulated GPUs writes (every key of
``gpu/{i}/...``, ``gpu/all/...``, ``host/...``, ``perf/...``, ``train/...``; one dumped row is
``REAL_ROW``), with noise around healthy values.  Each rule gets a fault injected at a known step
and must fire within 20 steps of it; the same streams without the fault, noisy, must never fire
anything, and values hovering at a threshold must not flap.  ``test_a_real_monitor_run_...``
feeds the engine the rows of a real ``Monitor`` run on simulated GPUs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpulens.engine.rules import (
    RULES,
    RuleEngine,
    RulesConfig,
    rules_table,
    theil_sen,
)
from gpulens.model import Event, GpuInfo
from tests.support.inprocess import run_main

TOTAL_GB = 85.89934592  # 80 GiB, as a simulated H100 reports it
GPUS = tuple(
    GpuInfo(index=i, name="Simulated H100 80GB HBM3", uuid=f"GPU-{i}", pci_bus_id=f"0:{i}",
            mem_total_gb=TOTAL_GB, power_limit_w=700.0)
    for i in range(8)
)

# One row written by Monitor(backend=SimulatedNVML(gpus=2)) (trimmed to GPU 0 and the job
# keys): the stream below produces every one of these keys, per GPU.
REAL_ROW = {
    "gpu/0/dram_bw_pct": 14.69, "gpu/0/energy_j": 192.87, "gpu/0/mem_pct": 74.39,
    "gpu/0/mem_used_gb": 63.90, "gpu/0/mem_used_gb_max": 64.94, "gpu/0/power_limit_w": 700.0,
    "gpu/0/power_w": 653.71, "gpu/0/power_w_max": 662.18, "gpu/0/samples": 3.0,
    "gpu/0/sm_active_pct": 91.83, "gpu/0/sm_clock_mhz": 1800.0, "gpu/0/sm_occupancy_pct": 12.86,
    "gpu/0/temp_c": 73.52, "gpu/0/temp_c_max": 74.0, "gpu/0/tensor_active_pct": 85.40,
    "gpu/0/throttle_pct": 100.0, "gpu/0/throttle_power_pct": 100.0,
    "gpu/0/throttle_thermal_pct": 0.0, "gpu/0/util_pct": 97.18,
    "gpu/all/power_w_mean": 648.27, "host/cpu_pct": 97.98, "host/ram_used_gb": 1.16,
    "perf/energy_per_step_j": 383.73, "perf/step_time_s": 0.3001, "perf/steps": 1.0,
    "train/global_step": 5.0, "train/grad_norm": 0.5, "train/learning_rate": 0.001,
    "train/loss": 0.2,
}

Fault = Callable[[int, dict[str, float], random.Random], None]
"""Changes a row in place: (step, values, rng)."""


@dataclass
class Stream:
    """Rows of a healthy, noisy training run; ``faults`` change rows from their step on."""

    gpus: int = 2
    seed: int = 0
    step_time: float = 0.25
    gpm: bool = True
    phases: bool = True
    """The loop reports step anatomy (``perf/data_wait_pct``), as the HF/Lightning callbacks do."""
    alloc_counters: bool = True
    cpu_busy: bool = False
    """Distributed rows with ``rank/{r}/cpu_busy_s``."""
    faults: list[tuple[int, Fault]] = field(default_factory=list)
    t0: float = 1.8e9

    def rows(self, n: int) -> Iterator[tuple[int, float, dict[str, float]]]:
        rng = random.Random(self.seed)
        t = self.t0
        retries = [0.0] * self.gpus
        for step in range(1, n + 1):
            st = max(0.05, rng.gauss(self.step_time, 0.01 * self.step_time))
            v: dict[str, float] = {}
            for i in range(self.gpus):
                act = min(1.0, max(0.0, rng.gauss(0.86, 0.04)))
                used = 55 + 5 * act + rng.uniform(-0.5, 0.5)
                power = 70 + 560 * act + rng.gauss(0, 15)
                thr = max(0.0, min(100.0, rng.gauss(4, 4)))
                g = {
                    "util_pct": min(100.0, 100 * act * 1.1 + rng.uniform(0, 3)),
                    "mem_used_gb": used, "mem_used_gb_max": used + rng.uniform(0.2, 1.5),
                    "mem_pct": 100 * used / TOTAL_GB,
                    "power_w": power, "power_w_max": power + rng.uniform(5, 30),
                    "power_limit_w": 700.0, "energy_j": power * st,
                    "temp_c": 60 + 15 * act + rng.gauss(0, 1), "sm_clock_mhz": 1980 - 30 * act,
                    "throttle_pct": thr, "throttle_power_pct": thr,
                    "throttle_thermal_pct": 0.0,
                    # read at log(), the same point of every step; now and then a reading
                    # catches a transient buffer
                    "torch_allocated_gb": 20 + rng.gauss(0, 0.02)
                    + (rng.uniform(1.0, 3.0) if rng.random() < 0.1 else 0.0),
                    "torch_peak_gb": 24.0, "samples": max(1.0, round(st / 0.1)),
                }
                g["temp_c_max"] = g["temp_c"] + rng.uniform(0, 2)
                if self.gpm:
                    sm = 100 * act * 0.97
                    g |= {"sm_active_pct": sm, "sm_occupancy_pct": 12 + rng.gauss(0, 1),
                          "tensor_active_pct": sm * rng.uniform(0.55, 0.8),
                          "dram_bw_pct": 15 + rng.gauss(0, 2)}
                if self.alloc_counters:
                    g["torch_alloc_retries"] = retries[i]
                    g["torch_ooms"] = 0.0
                for k, x in g.items():
                    v[f"gpu/{i}/{k}"] = x
                if self.cpu_busy:
                    v[f"rank/{i}/cpu_busy_s"] = st * rng.uniform(0.78, 0.84)
            v |= {"host/cpu_pct": rng.uniform(20, 60), "host/ram_used_gb": 30.0,
                  "perf/step_time_s": st, "perf/steps": 1.0,
                  "perf/energy_per_step_j": sum(v[f"gpu/{i}/energy_j"] for i in range(self.gpus)),
                  "train/global_step": float(step), "train/loss": 3.0 / math.sqrt(step),
                  "train/learning_rate": 1e-4, "train/grad_norm": rng.uniform(0.5, 1.5)}
            if self.phases:
                wait = max(0.0, rng.gauss(1.5, 1.0))
                v |= {"perf/data_wait_pct": wait, "perf/data_wait_s": st * wait / 100,
                      "perf/forward_backward_pct": 80.0, "perf/optimizer_pct": 18.5 - wait / 2}
            for at, fault in self.faults:
                if step >= at:
                    fault(step, v, rng)
            for i in range(self.gpus):
                if f"gpu/{i}/torch_alloc_retries" in v:
                    retries[i] = v[f"gpu/{i}/torch_alloc_retries"]
            if self.gpus > 1:
                for m in ("util_pct", "sm_active_pct", "power_w", "mem_used_gb", "temp_c"):
                    xs = [v[f"gpu/{i}/{m}"] for i in range(self.gpus) if f"gpu/{i}/{m}" in v]
                    if xs:
                        v |= {f"gpu/all/{m}_mean": sum(xs) / len(xs),
                              f"gpu/all/{m}_min": min(xs), f"gpu/all/{m}_max": max(xs)}
            t += v["perf/step_time_s"]
            yield step, t, v


@dataclass
class Run:
    events: list[Event]
    keys: dict[int, dict[str, float]]
    """alert keys after each step"""

    def alerts(self, name: str | None = None, state: str | None = None) -> list[Event]:
        return [e for e in self.events if e.kind == "alert" and (name is None or e.name == name)
                and (state is None or e.state == state)]

    def first_firing(self, name: str) -> int | None:
        fired = self.alerts(name, "firing")
        return fired[0].step if fired else None


def run(stream: Stream, n: int, config: RulesConfig | None = None) -> Run:
    engine = RuleEngine(config or RulesConfig(gpus=GPUS[: stream.gpus]))
    events: list[Event] = []
    keys: dict[int, dict[str, float]] = {}
    for step, t, v in stream.rows(n):
        got = engine.feed(v, step, t)
        for e in got:
            assert e.step == step and e.time == t
        events.extend(got)
        keys[step] = engine.alert_keys()
    return Run(events, keys)


# -- faults, each shaped like what the hardware / loop would show ---------------------------

def slow_getitem(step: int, v: dict[str, float], rng: random.Random) -> None:
    """Each batch takes ~0.15 s more to load: the step grows and the wait shows in the anatomy;
    the GPUs sit idle meanwhile."""
    extra = rng.uniform(0.12, 0.18)
    busy = v["perf/step_time_s"]
    st = busy + extra
    v["perf/step_time_s"] = st
    if "perf/data_wait_pct" in v:
        v["perf/data_wait_s"] += extra
        v["perf/data_wait_pct"] = 100 * v["perf/data_wait_s"] / st
    for key in list(v):
        if key.endswith(("/util_pct", "/sm_active_pct", "/tensor_active_pct")):
            v[key] *= busy / st


def power_cap(step: int, v: dict[str, float], rng: random.Random) -> None:
    for i in range(2):
        v[f"gpu/{i}/power_w"] = rng.uniform(680, 699)
        v[f"gpu/{i}/throttle_power_pct"] = v[f"gpu/{i}/throttle_pct"] = rng.uniform(60, 100)
        v[f"gpu/{i}/sm_clock_mhz"] = rng.uniform(1600, 1750)


def hot_gpu1(step: int, v: dict[str, float], rng: random.Random) -> None:
    v["gpu/1/temp_c"] = rng.uniform(86, 89)
    v["gpu/1/temp_c_max"] = v["gpu/1/temp_c"] + 2
    v["gpu/1/throttle_thermal_pct"] = rng.uniform(15, 60)
    v["gpu/1/throttle_pct"] = max(v["gpu/1/throttle_pct"], v["gpu/1/throttle_thermal_pct"])
    v["gpu/1/sm_clock_mhz"] = rng.uniform(1300, 1500)


def fp32_matmuls(step: int, v: dict[str, float], rng: random.Random) -> None:
    """An fp32 matmul loop: the SMs are busy but the tensor pipes idle."""
    for i in range(2):
        v[f"gpu/{i}/sm_active_pct"] = rng.uniform(80, 95)
        v[f"gpu/{i}/tensor_active_pct"] = rng.uniform(0.0, 3.0)


def small_batch(step: int, v: dict[str, float], rng: random.Random) -> None:
    """Tiny kernels: NVML says busy (some kernel always runs), few SMs do anything."""
    for i in range(2):
        v[f"gpu/{i}/util_pct"] = rng.uniform(85, 99)
        if f"gpu/{i}/sm_active_pct" in v:
            v[f"gpu/{i}/sm_active_pct"] = rng.uniform(10, 24)
            v[f"gpu/{i}/tensor_active_pct"] = rng.uniform(5, 12)


def host_bound_no_gpm(step: int, v: dict[str, float], rng: random.Random) -> None:
    """No GPM (pre-Hopper): utilization low while the step anatomy says the data is there."""
    for i in range(2):
        v[f"gpu/{i}/util_pct"] = rng.uniform(25, 45)


def memory_full(step: int, v: dict[str, float], rng: random.Random) -> None:
    v["gpu/0/mem_used_gb_max"] = rng.uniform(78.5, 80.5)
    v["gpu/0/mem_used_gb"] = v["gpu/0/mem_used_gb_max"] - 1
    v["gpu/0/mem_pct"] = 100 * v["gpu/0/mem_used_gb"] / TOTAL_GB


def alloc_retries(step: int, v: dict[str, float], rng: random.Random) -> None:
    if step % 2 == 0:
        v["gpu/0/torch_alloc_retries"] += rng.randint(1, 3)


def make_ramp(start: int, gb_per_step: float) -> Fault:
    def ramp(step: int, v: dict[str, float], rng: random.Random) -> None:
        v["gpu/0/torch_allocated_gb"] += gb_per_step * (step - start)
    return ramp


def slow_rank1_gpm(step: int, v: dict[str, float], rng: random.Random) -> None:
    """Rank 1 computes longer; the others wait in the all-reduce (NCCL spinning on few SMs)."""
    for key in [k for k in v if k.endswith("/sm_active_pct") and not k.startswith("gpu/all")]:
        v[key] = rng.uniform(60, 68)
    v["gpu/1/sm_active_pct"] = rng.uniform(88, 95)


def slow_rank1_cpu(step: int, v: dict[str, float], rng: random.Random) -> None:
    st = v["perf/step_time_s"]
    v["rank/1/cpu_busy_s"] = st * rng.uniform(0.95, 1.0)
    v["rank/0/cpu_busy_s"] = st * rng.uniform(0.55, 0.60)  # CPU basis: fires at a 50 % lag


ONSET = 40


def assert_fires_once_within_20(r: Run, name: str, onset: int = ONSET) -> Event:
    fired = r.alerts(name, "firing")
    assert fired, f"{name} never fired; events: {r.events}"
    assert onset <= fired[0].step <= onset + 20, (fired[0].step, fired[0].message)
    assert len(fired) == 1 and not r.alerts(name, "resolved"), r.alerts(name)
    others = [e for e in r.events if e.name != name]
    assert not others, [(e.name, e.step, e.message) for e in others]
    assert r.keys[fired[0].step][f"alerts/{name}"] == 1.0
    assert r.keys[fired[0].step - 1][f"alerts/{name}"] == 0.0
    e = fired[0]
    assert e.kind == "alert" and e.severity == RULES[name].severity and e.advice and e.data
    assert any(ch.isdigit() for ch in e.message)
    return e


# -- healthy runs -----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["gpm+phases", "nvml-only", "no-phases", "ddp-gpm", "ddp-cpu"])
def test_a_healthy_noisy_run_fires_nothing(kind: str, seed: int) -> None:
    stream = Stream(seed=seed, gpm=kind != "nvml-only", phases=kind != "no-phases",
                    gpus=4 if kind.startswith("ddp") else 2, cpu_busy=kind == "ddp-cpu")
    config = RulesConfig(dtype="bf16", gpus=GPUS[: stream.gpus],
                         distributed=kind.startswith("ddp"))
    r = run(stream, 400, config)
    assert r.events == []
    keys = r.keys[400]
    assert keys and set(keys.values()) == {0.0}
    expected = {"input_bound", "power_capped", "thermal", "under_used", "memory_headroom",
                "memory_alloc_retries", "memory_creep"}
    if kind != "nvml-only":
        expected.add("low_tensor_use")
    if kind.startswith("ddp"):
        expected.add("slow_rank")
    assert set(keys) == {f"alerts/{n}" for n in expected}


def test_steps_of_a_healthy_run_that_log_every_10_steps_fire_nothing() -> None:
    # a row per 10 steps: windows 10x longer, steps advance by 10
    stream = Stream(step_time=2.5, seed=7)
    engine = RuleEngine(RulesConfig(gpus=GPUS[:2], dtype="bf16"))
    for n, t, v in stream.rows(100):
        v["perf/steps"] = 10.0
        v["perf/step_time_s"] /= 10
        assert engine.feed(v, n * 10, t) == []


# -- every rule fires within 20 steps of its fault, and only it ------------------------------

def test_input_bound_fires_on_data_wait() -> None:
    r = run(Stream(faults=[(ONSET, slow_getitem)]), 120)
    e = assert_fires_once_within_20(r, "input_bound")
    assert "waited for its next batch" in e.message and "perf/data_wait_pct" in e.message
    assert 30 < e.data["perf/data_wait_pct"] < 50
    assert "num_workers" in e.advice


def test_input_bound_fires_on_idle_gpus_when_the_loop_has_no_step_anatomy() -> None:
    r = run(Stream(phases=False, faults=[(ONSET, slow_getitem)]), 120)
    e = assert_fires_once_within_20(r, "input_bound")
    assert "ran no kernel" in e.message and "no perf/data_wait_pct" in e.message
    assert 0.1 < e.data["idle_s"] < 0.25


def test_power_capped_fires_per_gpu_and_names_them() -> None:
    r = run(Stream(faults=[(ONSET, power_cap)]), 120)
    e = assert_fires_once_within_20(r, "power_capped")
    assert "GPU 0" in e.message and "GPU 1" in e.message and "700 W limit" in e.message
    assert e.data["gpu/1/power_limit_w"] == 700.0 and e.data["gpu/0/throttle_power_pct"] > 50
    assert e.severity == "info"


def test_power_cap_bit_without_power_near_the_limit_is_not_power_capped() -> None:
    # the H200 set the power-cap reason in idle phases too (docs/design-notes.md)
    def bit_only(step: int, v: dict[str, float], rng: random.Random) -> None:
        for i in range(2):
            v[f"gpu/{i}/throttle_power_pct"] = rng.uniform(60, 100)

    assert run(Stream(faults=[(ONSET, bit_only)]), 120).events == []


def test_thermal_fires_for_the_hot_gpu_only() -> None:
    r = run(Stream(faults=[(ONSET, hot_gpu1)]), 120)
    e = assert_fires_once_within_20(r, "thermal")
    assert "GPU 1" in e.message and "GPU 0" not in e.message and "°C" in e.message
    assert set(e.data) >= {"gpu/1/throttle_thermal_pct", "gpu/1/temp_c"}


def test_low_tensor_use_fires_in_a_bf16_run_only() -> None:
    stream = Stream(faults=[(ONSET, fp32_matmuls)])
    r = run(stream, 120, RulesConfig(dtype="bf16", gpus=GPUS[:2]))
    e = assert_fires_once_within_20(r, "low_tensor_use")
    assert "bf16 run" in e.message and "autocast" in e.advice
    for dtype in (None, "fp32", "weird"):
        quiet = run(stream, 120, RulesConfig(dtype=dtype, gpus=GPUS[:2]))
        assert quiet.events == [] and "alerts/low_tensor_use" not in quiet.keys[120]


def test_under_used_fires_on_low_sm_activity() -> None:
    r = run(Stream(faults=[(ONSET, small_batch)]), 120)
    e = assert_fires_once_within_20(r, "under_used")
    assert "SMs busy (GPM SM activity)" in e.message and "larger (micro-)batch" in e.advice


def test_under_used_falls_back_to_nvml_utilization_without_gpm_and_says_so() -> None:
    r = run(Stream(gpm=False, faults=[(ONSET, host_bound_no_gpm)]), 120)
    e = assert_fires_once_within_20(r, "under_used")
    assert "NVML utilization" in e.message and "no GPM" in e.message
    assert 25 < e.data["gpu/0/util_pct"] < 45


def test_an_input_bound_run_is_not_also_under_used() -> None:
    # without GPM and without step anatomy, idle GPUs are input_bound, not "under-used" too
    def starving(step: int, v: dict[str, float], rng: random.Random) -> None:
        slow_getitem(step, v, rng)
        for i in range(2):
            v[f"gpu/{i}/util_pct"] = rng.uniform(20, 35)
    r = run(Stream(gpm=False, phases=False, faults=[(ONSET, starving)]), 120)
    assert_fires_once_within_20(r, "input_bound")


def test_memory_headroom_fires_under_10_pct() -> None:
    r = run(Stream(faults=[(ONSET, memory_full)]), 120)
    e = assert_fires_once_within_20(r, "memory_headroom")
    assert "GPU 0" in e.message and "85.90 GB" in e.message
    assert e.data["gpu/0/headroom_pct"] < 10


def test_memory_headroom_reads_the_total_from_mem_pct_when_the_context_lacks_it() -> None:
    gpus = tuple(GpuInfo(i, "x", f"u{i}", f"p{i}") for i in range(2))
    r = run(Stream(faults=[(ONSET, memory_full)]), 120, RulesConfig(gpus=gpus))
    e = assert_fires_once_within_20(r, "memory_headroom")
    assert e.data["gpu/0/mem_total_gb"] == pytest.approx(TOTAL_GB, rel=1e-6)


def test_allocator_retries_fire() -> None:
    r = run(Stream(faults=[(ONSET, alloc_retries)]), 120)
    e = assert_fires_once_within_20(r, "memory_alloc_retries")
    assert "allocation retries" in e.message and "expandable_segments" in e.advice


def test_one_oom_after_warm_up_fires_at_once_and_clears() -> None:
    def oom(step: int, v: dict[str, float], rng: random.Random) -> None:
        v["gpu/1/torch_ooms"] = 1.0

    r = run(Stream(faults=[(ONSET, oom)]), 120)
    fired = r.alerts("memory_alloc_retries", "firing")
    assert [f.step for f in fired] == [ONSET], r.events
    assert "1 out-of-memory error" in fired[0].message and "GPU 1" in fired[0].message
    resolved = r.alerts("memory_alloc_retries", "resolved")
    assert len(resolved) == 1 and ONSET + 10 <= resolved[0].step <= ONSET + 20


def test_oom_counts_before_monitoring_started_are_a_baseline() -> None:
    def old(step: int, v: dict[str, float], rng: random.Random) -> None:
        v["gpu/0/torch_ooms"] = 3.0
        v["gpu/0/torch_alloc_retries"] = 12.0

    assert run(Stream(faults=[(1, old)]), 100).events == []


def test_memory_creep_fires_on_a_ramp_through_the_sawtooth() -> None:
    r = run(Stream(faults=[(ONSET, make_ramp(ONSET, 0.1))]), 120)
    e = assert_fires_once_within_20(r, "memory_creep")
    assert "GPU 0" in e.message and "MB per step" in e.message and "more steps" in e.message
    assert 0.05 < e.data["gpu/0/slope_gb_per_step"] < 0.15


def test_memory_creep_counts_a_reading_carried_into_later_windows_once() -> None:
    # 0.1 s steps: the sampler reads the allocator about once a second and carries the reading
    # into the windows until the next one
    def staircase(ramp: float) -> Fault:
        held: dict[str, float] = {}

        def fault(step: int, v: dict[str, float], rng: random.Random) -> None:
            if step % 10 == 1:
                held["gb"] = v["gpu/0/torch_allocated_gb"] + ramp * max(0, step - 100)
            v["gpu/0/torch_allocated_gb"] = held["gb"]
        return fault

    r = run(Stream(step_time=0.1, faults=[(1, staircase(0.02))]), 600)
    fired = r.alerts("memory_creep", "firing")
    assert len(fired) == 1 and fired[0].step > 100, r.events
    assert fired[0].data["gpu/0/slope_gb_per_step"] == pytest.approx(0.02, rel=0.25)
    assert [e.name for e in r.events] == ["memory_creep"]
    assert run(Stream(step_time=0.1, faults=[(1, staircase(0.0))]), 600).events == []


def test_slow_rank_from_gpm_is_named_and_chronic() -> None:
    stream = Stream(gpus=4, faults=[(ONSET, slow_rank1_gpm)])
    r = run(stream, 120, RulesConfig(gpus=GPUS[:4], distributed=True))
    e = assert_fires_once_within_20(r, "slow_rank")
    # GPU busy time (GPM) lags: the GPU is named (its key is the rank's)
    assert e.message.startswith("a slow rank sets the pace of the job: GPU 1 (rank 1) is "
                                "chronically slow")
    assert "GPM" in e.message and e.data["rank"] == 1.0 and e.data["rank/1/lag_pct"] > 20
    # a single GPU row set is not a job of ranks: no slow_rank without distributed=True
    quiet = run(stream, 120, RulesConfig(gpus=GPUS[:4]))
    assert "alerts/slow_rank" not in quiet.keys[120]


def test_slow_rank_from_cpu_busy_time_when_there_is_no_gpm() -> None:
    stream = Stream(gpus=2, gpm=False, cpu_busy=True, faults=[(ONSET, slow_rank1_cpu)])
    r = run(stream, 120, RulesConfig(gpus=GPUS[:2], distributed=True))
    e = assert_fires_once_within_20(r, "slow_rank")
    assert "rank 1" in e.message and "rank/{r}/cpu_busy_s" in e.message


def test_a_one_off_lag_is_a_notice_not_an_alert() -> None:
    def spike(step: int, v: dict[str, float], rng: random.Random) -> None:
        if step == 60:
            v["rank/1/cpu_busy_s"] = 2.5 * v["rank/0/cpu_busy_s"]

    stream = Stream(gpus=2, gpm=False, cpu_busy=True, faults=[(1, spike)])
    r = run(stream, 120, RulesConfig(gpus=GPUS[:2], distributed=True))
    assert r.alerts() == []
    (notice,) = r.events
    assert notice.kind == "notice" and notice.name == "slow_rank" and notice.step == 63
    assert "rank 1 lagged once at step 60" in notice.message and "one-off" in notice.message
    assert notice.data["rank"] == 1.0 and notice.data["rank/1/lag_pct"] > 100
    assert notice.data["spike_step"] == 60.0


# -- timing, hysteresis, resolve --------------------------------------------------------------

def test_a_condition_present_from_the_start_fires_at_step_20_not_before() -> None:
    r = run(Stream(faults=[(1, slow_getitem)]), 60)
    assert r.first_firing("input_bound") == 20
    assert all(r.keys[s]["alerts/input_bound"] == 0.0 for s in range(1, 20))


def test_a_fault_that_ends_is_resolved_once_and_the_key_goes_back_to_0() -> None:
    def until_80(step: int, v: dict[str, float], rng: random.Random) -> None:
        if step < 80:
            hot_gpu1(step, v, rng)

    r = run(Stream(faults=[(ONSET, until_80)]), 140)
    assert [(e.state) for e in r.events] == ["firing", "resolved"]
    resolved = r.events[1]
    assert 80 <= resolved.step <= 90 and "GPU 1 thermal throttling" in resolved.message
    assert r.keys[resolved.step]["alerts/thermal"] == 0.0
    assert r.keys[resolved.step - 1]["alerts/thermal"] == 1.0


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("rule", "key", "threshold"), [
    ("input_bound", "perf/data_wait_pct", "data_wait"),
    ("thermal", "gpu/{i}/throttle_thermal_pct", "throttle_thermal"),
    ("under_used", "gpu/{i}/sm_active_pct", "sm_active"),
    ("memory_headroom", "gpu/{i}/mem_used_gb_max", "headroom"),
])
def test_values_hovering_at_a_threshold_do_not_flap(rule: str, key: str, threshold: str,
                                                    seed: int) -> None:
    t = RULES[rule].threshold(threshold)
    gap = abs(t.fire - t.clear)
    sign = 1.0 if t.op == ">=" else -1.0

    def value_of(x: float) -> float:
        # headroom (%) is read from the peak memory used
        return TOTAL_GB * (1 - x / 100) if rule == "memory_headroom" else max(0.0, x)

    def phases(step: int, v: dict[str, float], rng: random.Random) -> None:
        if step < 100:    # at the fire threshold
            x = t.fire + rng.uniform(-0.4, 0.4) * gap
        elif step < 160:  # clearly past it
            x = t.fire + sign * gap * rng.uniform(0.8, 1.2)
        elif step < 260:  # between the thresholds
            x = (t.fire + t.clear) / 2 + rng.uniform(-0.3, 0.3) * gap
        elif step < 460:  # at the clear threshold
            x = t.clear + rng.uniform(-0.4, 0.4) * gap
        else:             # clearly healthy
            x = t.clear - sign * gap * rng.uniform(0.8, 1.2)
        v[key.format(i=0)] = value_of(x)

    r = run(Stream(seed=seed, faults=[(ONSET, phases)]), 520)
    states = [(e.state, e.step) for e in r.alerts(rule)]
    # one firing (at the fire threshold or at the latest 20 steps into the clear excess),
    # nothing while between, at most one resolve (at the clear threshold or once healthy)
    assert [s for s, _ in states] == ["firing", "resolved"], states
    assert ONSET + 8 <= states[0][1] <= 120 and 260 <= states[1][1] <= 480, states
    assert [e for e in r.events if e.name != rule] == []


def test_a_gpu_that_stops_reporting_is_resolved_as_no_longer_measured() -> None:
    def lost(step: int, v: dict[str, float], rng: random.Random) -> None:
        if step < 70:
            hot_gpu1(step, v, rng)
        else:
            for key in [k for k in v if k.startswith("gpu/1/")]:
                del v[key]

    r = run(Stream(faults=[(ONSET, lost)]), 260)
    states = [(e.state, e.step) for e in r.alerts("thermal")]
    assert [s for s, _ in states] == ["firing", "resolved"]
    resolved = r.alerts("thermal", "resolved")[0]
    assert "no longer measured since step 69" in resolved.message
    assert resolved.step >= 70 + 20  # 20 rows and 30 s without the GPU


def test_a_second_gpu_joining_a_firing_rule_is_told_and_the_rule_resolves_once() -> None:
    def both(step: int, v: dict[str, float], rng: random.Random) -> None:
        if step < 120:
            hot_gpu1(step, v, rng)
        if 70 <= step < 140:
            v["gpu/0/throttle_thermal_pct"] = rng.uniform(20, 40)

    r = run(Stream(faults=[(ONSET, both)]), 200)
    firing = r.alerts("thermal", "firing")
    assert len(firing) == 2 and "GPU 0" in firing[1].message
    assert "already firing for GPU 1" in firing[1].message
    resolved = r.alerts("thermal", "resolved")
    assert len(resolved) == 1 and resolved[0].step >= 140


def test_idle_gpus_the_job_does_not_use_are_not_under_used() -> None:
    # 2 GPUs train; GPUs 2 and 3 of the node sit idle with nothing allocated
    def idle_neighbours(step: int, v: dict[str, float], rng: random.Random) -> None:
        for i in (2, 3):
            for key in [k for k in v if k.startswith(f"gpu/{i}/torch_")]:
                del v[key]
            v |= {f"gpu/{i}/util_pct": 0.0, f"gpu/{i}/sm_active_pct": 0.0,
                  f"gpu/{i}/tensor_active_pct": 0.0, f"gpu/{i}/power_w": 70.0,
                  f"gpu/{i}/mem_used_gb": 0.5, f"gpu/{i}/mem_used_gb_max": 0.5}

    r = run(Stream(gpus=4, faults=[(1, idle_neighbours)]), 200)
    assert r.events == []


def test_a_failing_rule_is_switched_off_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    from gpulens.engine.rules.thermal import Thermal
    from gpulens.log import reset_warnings

    def broken(self: object, view: object) -> dict[str, object]:
        raise ZeroDivisionError("boom")

    reset_warnings()
    monkeypatch.setattr(Thermal, "observe", broken)
    caplog.set_level(logging.WARNING, logger="gpulens")
    r = run(Stream(faults=[(ONSET, power_cap)]), 120)
    warnings = [rec for rec in caplog.records if "thermal" in rec.getMessage()]
    assert len(warnings) == 1 and "switched off" in warnings[0].getMessage()
    assert "ZeroDivisionError: boom" in warnings[0].getMessage()
    assert "alerts/thermal" not in r.keys[120]
    assert r.first_firing("power_capped") is not None  # the others go on
    reset_warnings()


def test_a_row_the_rules_cannot_read_is_skipped_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    from gpulens.log import reset_warnings

    reset_warnings()
    caplog.set_level(logging.WARNING, logger="gpulens")
    engine = RuleEngine(RulesConfig(gpus=GPUS[:2]))
    for step, t, v in Stream(faults=[(ONSET, hot_gpu1)]).rows(80):
        if step in (10, 11):
            v[7] = 1.0  # type: ignore[index]  # not a key any row can have
        engine.feed(v, step, t)
    warnings = [r.getMessage() for r in caplog.records if "could not read" in r.getMessage()]
    assert len(warnings) == 1 and "AttributeError" in warnings[0]
    assert engine.firing() == {"thermal": ("1",)}
    reset_warnings()


def test_non_finite_and_non_numeric_values_are_absent_not_zero() -> None:
    engine = RuleEngine(RulesConfig(gpus=GPUS[:1]))
    for step, t, v in Stream(gpus=1).rows(60):
        v["gpu/0/throttle_thermal_pct"] = math.nan
        v["gpu/0/sm_active_pct"] = math.inf
        v["train/note"] = "text"  # type: ignore[assignment]
        assert engine.feed(v, step, t) == []
    keys = engine.alert_keys()
    assert "alerts/thermal" not in keys and keys["alerts/under_used"] == 0.0


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="unknown rule"):
        RulesConfig(disabled=frozenset({"nope"}))
    engine = RuleEngine(RulesConfig(disabled=frozenset({"thermal"}), gpus=GPUS[:2]))
    assert "thermal" not in engine.rules
    for step, t, v in Stream(faults=[(ONSET, hot_gpu1)]).rows(120):
        assert engine.feed(v, step, t) == []
    assert "alerts/thermal" not in engine.alert_keys()


@pytest.mark.parametrize(("given", "expected"), [
    ("bf16", "bf16"), ("bf16-mixed", "bf16"), ("torch.bfloat16", "bf16"), ("16-mixed", "fp16"),
    ("fp16", "fp16"), (32, "fp32"), ("32-true", "fp32"), (None, None), ("int8", "int8"),
])
def test_normalize_dtype(given: object, expected: str | None) -> None:
    """The rules take the dtype as gpulens names it: the monitor turns every spelling it accepts
    (torch dtypes, their names, Lightning precision flags) into that name before the engine,
    and so ``RulesConfig``, sees it (``low_tensor_use`` judges bf16 and fp16 only)."""
    from gpulens.settings import normalize_run_dtype

    assert normalize_run_dtype(given) == expected


def test_theil_sen_ignores_outliers() -> None:
    xs = [float(x) for x in range(20)]
    ys = [2.0 * x for x in xs]
    ys[3], ys[11] = 500.0, -500.0
    slope, rising = theil_sen(xs, ys)
    assert slope == pytest.approx(2.0) and rising > 0.8
    assert theil_sen([1.0, 1.0], [0.0, 5.0]) == (0.0, 0.5)


def test_the_module_docstring_states_the_thresholds_of_the_table() -> None:
    from gpulens.engine import rules

    doc = rules.__doc__ or ""
    start = doc.index("rule                   subject")
    table = doc[start: doc.index("Keys read, per GPU")]
    segments: dict[str, str] = {}
    current = ""
    for line in table.splitlines():
        name = line.split(" ", 1)[0]
        if name in RULES:
            current = name
        if current:
            segments[current] = segments.get(current, "") + " " + line
    assert set(segments) == set(RULES)
    for spec in RULES.values():
        for t in spec.thresholds:
            for number in (t.fire, t.clear):
                assert f"{number:g}" in segments[spec.name], (spec.name, t.name, number)
    assert "| power_capped | gpu | info | throttle_power |" in rules_table()


def _steady_load(gpu: int, t: float) -> float:
    """A healthy training's activity: busy, a little noise, no power cap (simulated GPUs set the
    cap bit above 0.9)."""
    return 0.8 + 0.03 * math.sin(7.0 * t + gpu)


def test_a_real_monitor_run_on_simulated_gpus_fires_nothing_and_gets_every_key() -> None:
    import gpulens
    from gpulens.testing import MemorySink, SimulatedNVML

    sink = MemorySink()
    mon = gpulens.Monitor(backend=SimulatedNVML(gpus=2, load=_steady_load), interval=0.05,
                          sinks=[sink], isolation="thread")
    mon.start(step=0)
    for step in range(1, 46):
        time.sleep(0.06)
        mon.log(step, loss=1.0 / step)
    mon.stop()
    assert len(sink.rows) == 45
    engine = RuleEngine(RulesConfig(dtype="bf16", gpus=mon.context.gpus,
                                    min_span_s=0.5))
    for row in sink.rows:
        assert engine.feed(row.values, row.step, row.time) == []
    assert engine.alert_keys() == {f"alerts/{n}": 0.0 for n in (
        "input_bound", "power_capped", "thermal", "low_tensor_use", "under_used",
        "memory_headroom")}


def test_the_cost_benchmark_runs_and_prints_its_figures(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "rules_cost.py"), "--quick", "--json",
         str(tmp_path / "cost.json")],
        env={**os.environ, "PYTHONPATH": str(root / "src")}, capture_output=True, text=True,
        timeout=120, check=True).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    assert [r[0].strip() for r in rows[1:]] == ["1 healthy", "1 faulty", "8 healthy",
                                                 "8 faulty"]
    events = {r[0].strip(): int(r[-1]) for r in rows[1:]}
    assert events["1 healthy"] == events["8 healthy"] == 0 and events["8 faulty"] > 0
    results = json.loads((tmp_path / "cost.json").read_text())["results"]
    assert all(r["cpu_median_us"] > 0 for r in results)


def test_the_gpu_check_script_runs_on_a_cpu_with_a_simulated_gpu(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULENS_")}
    # in this process (tests.support.inprocess): torch and transformers are not imported
    # again, and what the script changes in the process is put back
    out = run_main(root / "benchmarks" / "rules_gpu.py",
                   ["--quick", "--steps", "22", "--runs", "bf16,fp32_mm", "--out", str(tmp_path)],
                   tmp_path, {**env, "PYTHONPATH": str(root / "src")},
                   preload=("torch", "transformers"))
    table = [line for line in out.splitlines() if line.startswith(("| bf16 |", "| fp32_mm |"))]
    assert len(table) == 2 and all(" | 22 | " in line for line in table), out
    assert (tmp_path / "bf16.rows.jsonl").exists() and (tmp_path / "fp32_mm.events.jsonl").exists()
    assert len(json.loads((tmp_path / "rules_gpu.json").read_text())) == 2


class _Clocks:
    """Stands in for ``time`` in :mod:`gpulens.engine.finish`: wall and CPU clocks the test
    moves by hand (each judged row costs ``cost`` CPU seconds)."""

    def __init__(self, cost: float) -> None:
        self.wall = 100.0
        self.cpu = 0.0
        self.cost = cost

    def perf_counter(self) -> float:
        return self.wall

    def thread_time(self) -> float:
        return self.cpu


def test_rules_judge_every_row_within_their_cpu_share_and_thin_out_beyond_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpulens.engine import finish
    from gpulens.engine.spec import EngineSpec
    from gpulens.model import Row

    clocks = _Clocks(cost=300e-6)  # a row of 8 GPUs, as benchmarks/rules_cost.py measures it
    monkeypatch.setattr(finish, "time", clocks)
    finisher = finish.Finisher(EngineSpec(interval=0.1, dtype="bf16"), GPUS[:1])
    assert finisher.rules is not None
    judged: list[int] = []
    real_feed = finisher.rules.feed

    def feed(values: dict[str, float], step: int, t: float) -> list[Event]:
        judged.append(step)
        clocks.cpu += clocks.cost
        return real_feed(values, step, t)

    monkeypatch.setattr(finisher.rules, "feed", feed)

    def run(steps: range, every_s: float) -> list[int]:
        judged.clear()
        for step in steps:
            clocks.wall += every_s
            finisher.finish(Row(step=step, time=clocks.wall, values={
                "perf/step_time_s": every_s, "gpu/0/util_pct": 90.0}))
        return list(judged)

    # 20 rows a second cost 0.6 % of a core: every row is judged, for as long as it goes on
    assert run(range(1, 2001), 0.05) == list(range(1, 2001))
    # 1000 rows a second would cost 30 %: the bucket's burst (0.1 s of CPU) first, then the
    # share, 2 % of wall-clock time: 20 ms of CPU a second, ~67 rows of 0.3 ms
    fast = run(range(2001, 12001), 0.001)
    burst = round(finish.RULES_BURST_S / clocks.cost)
    assert fast[:burst] == list(range(2001, 2001 + burst))
    steady = len(fast) - burst
    seconds = 10_000 * 0.001
    assert abs(steady - seconds * finish.RULES_CPU_SHARE / clocks.cost) <= 3, steady
    # rows in between still carry the rules' state
    row = finisher.finish(Row(step=12001, time=clocks.wall, values={"gpu/0/util_pct": 90.0}))
    assert "alerts/under_used" in row.values
    # back to a slow loop: every row again, once the bucket has refilled
    clocks.wall += 10.0
    assert run(range(12002, 12102), 0.05) == list(range(12002, 12102))
