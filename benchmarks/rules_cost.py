"""What the advice rules cost per row: ``RuleEngine.feed`` + ``alert_keys`` on rows of 1 and 8
GPUs with every key the rules read (GPM, throttle reasons, allocator readings and counters,
per-rank CPU time), every rule on (bf16, distributed).

The rules run in the engine, beside the sampler that finishes the rows (in gpulens's engine
process by default; in a thread of the training process as the fallback, where their Python
competes for the training thread's GIL).  For scale: finishing a row of 8 GPUs costs the sampler
~0.5 ms of Python (docs/design-notes.md).

    python benchmarks/rules_cost.py [--rows 5000] [--json out.json] [--quick]

Prints a Markdown table: microseconds per row (median, p99, max of the wall clock; median and
p99 of the thread's CPU time) for each GPU count, for healthy
rows and for rows where every GPU rule fires (messages built).  Rows are 0.25 s apart; the
allocator reading changes every 4th row (the sampler reads it about once a second), so the
memory-creep fit runs on one row in four.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

from gpulens.engine.rules import RuleEngine, RulesConfig
from gpulens.model import GpuInfo

TOTAL_GB = 85.9


def row(gpus: int, step: int, rng: random.Random, faulty: bool) -> dict[str, float]:
    """A row with the keys a Monitor writes for ``gpus`` GPUs, plus the keys the rules add."""
    v: dict[str, float] = {}
    for i in range(gpus):
        act = rng.uniform(0.8, 0.9)
        power = 690.0 if faulty else 70 + 560 * act
        g = {
            "util_pct": 95.0, "sm_active_pct": (20.0 if faulty else 100 * act),
            "sm_occupancy_pct": 12.0, "tensor_active_pct": (1.0 if faulty else 60.0),
            "dram_bw_pct": 15.0, "mem_used_gb": 60.0,
            "mem_used_gb_max": (80.0 if faulty else 61.0), "mem_pct": 70.0,
            "power_w": power, "power_w_max": power + 10, "power_limit_w": 700.0,
            "energy_j": power * 0.25, "temp_c": 70.0, "temp_c_max": 72.0,
            "sm_clock_mhz": 1900.0, "throttle_pct": (90.0 if faulty else 3.0),
            "throttle_power_pct": (90.0 if faulty else 3.0),
            "throttle_thermal_pct": (40.0 if faulty else 0.0),
            # the sampler reads the allocator about once a second and carries the reading
            # into the windows until the next: a new value every 4th row of 0.25 s
            "torch_allocated_gb": 20 + (0.1 * (step // 4) if faulty else 0.01 * (step // 4 % 3)),
            "torch_peak_gb": 30.0, "samples": 3.0,
            "torch_alloc_retries": (float(step) if faulty else 0.0), "torch_ooms": 0.0,
        }
        v |= {f"gpu/{i}/{k}": x for k, x in g.items()}
        v[f"rank/{i}/cpu_busy_s"] = 0.2 * rng.uniform(0.95, 1.05)
    v |= {"perf/step_time_s": 0.25, "perf/steps": 1.0, "perf/data_wait_pct": 2.0,
          "perf/data_wait_s": 0.005, "train/global_step": float(step), "train/loss": 1.0,
          "host/cpu_pct": 30.0, "host/ram_used_gb": 20.0}
    return v


def measure(gpus: int, rows: int, faulty: bool) -> dict[str, float]:
    rng = random.Random(gpus)
    infos = tuple(GpuInfo(i, "gpu", f"u{i}", f"p{i}", TOTAL_GB, 700.0) for i in range(gpus))
    engine = RuleEngine(RulesConfig(dtype="bf16", gpus=infos, distributed=gpus > 1))
    prepared = [row(gpus, s, rng, faulty) for s in range(1, rows + 1)]
    times: list[float] = []
    cpu: list[float] = []
    events = 0
    for s, values in enumerate(prepared, start=1):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        events += len(engine.feed(values, s, 1.8e9 + 0.25 * s))
        engine.alert_keys()
        cpu.append((time.thread_time_ns() - c0) / 1000)
        times.append((time.perf_counter_ns() - t0) / 1000)
    times.sort()
    cpu.sort()
    return {"gpus": gpus, "rows": rows, "faulty": faulty, "events": events,
            "median_us": statistics.median(times),
            "p99_us": times[min(len(times) - 1, int(0.99 * len(times)))],
            "max_us": times[-1], "cpu_median_us": statistics.median(cpu),
            "cpu_p99_us": cpu[min(len(cpu) - 1, int(0.99 * len(cpu)))]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--quick", action="store_true", help="200 rows (smoke test)")
    args = ap.parse_args(argv)
    rows = 200 if args.quick else args.rows
    results = [measure(g, rows, f) for g in (1, 8) for f in (False, True)]
    print(f"# RuleEngine.feed + alert_keys per row ({rows} rows, Python "
          f"{platform.python_version()}, {platform.machine()})\n")
    print("| GPUs | rows | median us | p99 us | max us | CPU median us | CPU p99 us | events |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        kind = "faulty" if r["faulty"] else "healthy"
        print(f"| {r['gpus']} {kind} | {r['rows']} | {r['median_us']:.1f} | {r['p99_us']:.1f} | "
              f"{r['max_us']:.1f} | {r['cpu_median_us']:.1f} | {r['cpu_p99_us']:.1f} | "
              f"{r['events']} |")
    print(f"\n(wall-clock times include waits for the CPU; the CPU columns are this thread's CPU "
          f"time. Load average when it ended: {os.getloadavg()[0]:.2f} on {os.cpu_count()} "
          f"CPUs.)")
    if args.json:
        meta: dict[str, Any] = {"python": sys.version, "machine": platform.machine(),
                                "command": " ".join(sys.argv), "loadavg": os.getloadavg(),
                                "cpus": os.cpu_count()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
