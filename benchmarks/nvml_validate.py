"""Check gpulens's NVML path on a real GPU under a known load (run with the `device` tool).

Pattern: steps alternate a heavy bf16 matrix-product phase and an idle phase of the same
length; gpulens logs each step.  Printed per step: what gpulens's window says (SM active,
tensor active, NVML utilization, power, energy, samples) next to NVML's own energy counter
read at the step edges on this thread (the reference; gpulens itself never reads NVML on the
training thread).  Then the cost of each NVML read on this GPU, and what the driver's
buffered samples hold.

    python benchmarks/nvml_validate.py [--steps 12] [--phase 0.4] [--interval 0.1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--phase", type=float, default=0.4, help="seconds busy / idle per step")
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--gpm-lag", action="store_true", help="also print raw GPM spans")
    ap.add_argument(
        "--json", default=os.path.join(os.environ.get("OUT", "."), "nvml_validate.json")
    )
    args = ap.parse_args()

    import pynvml
    import torch

    import gpulens
    from gpulens.testing import MemorySink

    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    print(
        "GPU:",
        pynvml.nvmlDeviceGetName(handle),
        "driver",
        pynvml.nvmlSystemGetDriverVersion(),
        "NVML",
        pynvml.nvmlSystemGetNVMLVersion(),
        "torch",
        torch.__version__,
    )

    # -- cost of each NVML read ---------------------------------------------------------
    def cost(fn, *a, n=50):  # type: ignore[no-untyped-def]
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            try:
                fn(*a)
            except pynvml.NVMLError as exc:
                return f"error {exc}"
            ts.append(time.perf_counter() - t)
        return f"median {statistics.median(ts) * 1e6:.0f} us, max {max(ts) * 1e6:.0f} us"

    reads = {
        "utilization": (pynvml.nvmlDeviceGetUtilizationRates, handle),
        "memory": (pynvml.nvmlDeviceGetMemoryInfo, handle),
        "power": (pynvml.nvmlDeviceGetPowerUsage, handle),
        "temperature": (pynvml.nvmlDeviceGetTemperature, handle, 0),
        "clock events": (pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle),
        "energy counter": (pynvml.nvmlDeviceGetTotalEnergyConsumption, handle),
        "power samples": (pynvml.nvmlDeviceGetSamples, handle, 0, 0),
        "util samples": (pynvml.nvmlDeviceGetSamples, handle, 1, 0),
    }
    for name, (fn, *a) in reads.items():
        print(f"  NVML {name:15s} {cost(fn, *a, n=20)}")
    _, ps = pynvml.nvmlDeviceGetSamples(handle, 0, 0)
    _, us = pynvml.nvmlDeviceGetSamples(handle, 1, 0)
    for label, ss in (("power", ps), ("util", us)):
        if len(ss) > 1:
            gaps = [(b.timeStamp - a.timeStamp) / 1e3 for a, b in itertools.pairwise(ss)]
            print(
                f"  buffered {label} samples: {len(ss)},"
                f" spacing median {statistics.median(gaps):.1f} ms,"
                f" history {(ss[-1].timeStamp - ss[0].timeStamp) / 1e6:.2f} s,"
                f" newest {time.time() - ss[-1].timeStamp / 1e6:.3f} s old"
            )

    # -- the load ---------------------------------------------------------------------------
    a = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()

    def busy(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(4):
                a @ b
            torch.cuda.synchronize()

    busy(1.0)  # warm up clocks
    sink = MemorySink()
    edges = []
    with gpulens.Monitor(gpus=[0], interval=args.interval, sinks=[sink], backend="nvml") as mon:
        edges.append(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        for step in range(1, args.steps + 1):
            if step % 2:
                busy(args.phase)
            else:
                time.sleep(args.phase)
            mon.log(step, phase=1.0 if step % 2 else 0.0)
            edges.append(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    rows = [r.values for r in sink.rows]
    keys = [
        "sm_active_pct",
        "tensor_active_pct",
        "util_pct",
        "power_w",
        "energy_j",
        "temp_c",
        "sm_clock_mhz",
        "throttle_power_pct",
        "samples",
    ]
    print(f"\nper-step windows (interval {args.interval} s, {args.phase} s per step, odd = busy)")
    print("step  " + "  ".join(f"{k:>17s}" for k in keys) + "  counter_J")
    total_g = total_c = 0.0
    for i, r in enumerate(rows):
        ref = (edges[i + 1] - edges[i]) / 1000.0
        total_c += ref
        total_g += r.get("gpu/0/energy_j", float("nan"))
        print(
            f"{int(r['train/global_step']):4d}  "
            + "  ".join(f"{r.get('gpu/0/' + k, float('nan')):17.1f}" for k in keys)
            + f"  {ref:9.1f}"
        )
    print(
        f"energy over all steps: gpulens {total_g:.1f} J,"
        f" NVML counter at step edges {total_c:.1f} J"
    )
    lag = gpm_lag(pynvml, handle, busy) if args.gpm_lag else None
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "counter_edges_mj": edges, "gpm_lag": lag}, f)
    return 0


def gpm_lag(pynvml: Any, handle: Any, busy: Any) -> list[tuple[float, float, float]]:
    """Raw GPM spans (start, end relative to the busy phase's start, SM util %) around a 1 s
    busy phase run on another thread: shows how GPM's figures line up with host time."""
    import threading

    spans: list[tuple[float, float, float]] = []
    prev = pynvml.nvmlGpmSampleAlloc()
    cur = pynvml.nvmlGpmSampleAlloc()
    marks: dict[str, float] = {}

    def load() -> None:
        time.sleep(0.5)
        marks["start"] = time.monotonic()
        busy(1.0)
        marks["end"] = time.monotonic()

    worker = threading.Thread(target=load)
    pynvml.nvmlGpmSampleGet(handle, prev)
    t_prev = time.monotonic()
    worker.start()
    end = time.monotonic() + 2.5
    while time.monotonic() < end:
        time.sleep(0.05)
        t = time.monotonic()
        pynvml.nvmlGpmSampleGet(handle, cur)
        req = pynvml.c_nvmlGpmMetricsGet_t()
        req.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        req.numMetrics = 1
        req.sample1, req.sample2 = prev, cur
        req.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
        pynvml.nvmlGpmMetricsGet(req)
        spans.append((t_prev, t, req.metrics[0].value))
        prev, cur, t_prev = cur, prev, t
    worker.join()
    t0 = marks["start"]
    out = [(a - t0, b - t0, v) for a, b, v in spans]
    print(f"\nraw GPM SM util, 50 ms spans; busy from 0.000 to {marks['end'] - t0:.3f} s (host)")
    for a, b, v in out:
        print(f"  [{a:+.3f}, {b:+.3f}] s  {v:5.1f} %")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
