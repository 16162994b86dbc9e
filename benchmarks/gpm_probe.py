"""Probe how NVML's GPM counters refresh (run on a Hopper GPU with the device tool).

Samples GPM every ``--every`` seconds for 1.6 s while another thread keeps the GPU busy from
0.3 s to 1.0 s (host time), and prints each span's metrics and return codes: spans in which
the GPU's counters did not refresh show up here, and whether anything tells them apart from an
idle GPU.  Also asks whether GPM "streaming" is on.

    python benchmarks/gpm_probe.py [--every 0.02]
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=float, default=0.02)
    args = ap.parse_args()
    import pynvml
    import torch

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    try:
        print("streaming enabled:", pynvml.nvmlGpmQueryIfStreamingEnabled(h))
    except pynvml.NVMLError as exc:
        print("streaming query:", exc)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(50):
        a @ b
    torch.cuda.synchronize()
    ids = [2, 10, 20, 21, 1]  # SM util, DRAM bw, PCIe TX/s, PCIe RX/s, graphics util
    marks: dict[str, float] = {}

    def load() -> None:
        torch.cuda.set_device(0)
        time.sleep(0.3)
        marks["on"] = time.monotonic()
        end = time.monotonic() + 0.7
        while time.monotonic() < end:
            for _ in range(4):
                a @ b
            torch.cuda.synchronize()
        marks["off"] = time.monotonic()

    prev, cur = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    pynvml.nvmlGpmSampleGet(h, prev)
    t0 = t_prev = time.monotonic()
    worker = threading.Thread(target=load)
    worker.start()
    rows: list[tuple[float, float, list[Any]]] = []
    while time.monotonic() - t0 < 1.6:
        time.sleep(args.every)
        t = time.monotonic()
        pynvml.nvmlGpmSampleGet(h, cur)
        req = pynvml.c_nvmlGpmMetricsGet_t()
        req.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        req.numMetrics = len(ids)
        req.sample1, req.sample2 = prev, cur
        for i, m in enumerate(ids):
            req.metrics[i].metricId = m
        try:
            pynvml.nvmlGpmMetricsGet(req)
            got = [(req.metrics[i].nvmlReturn, req.metrics[i].value) for i in range(len(ids))]
        except pynvml.NVMLError as exc:
            got = [str(exc)]
        rows.append((t_prev - t0, t - t0, got))
        prev, cur, t_prev = cur, prev, t
    worker.join()
    print(f"busy from {marks['on'] - t0:.3f} to {marks['off'] - t0:.3f} s (host)")
    print("span (s)            SM%    DRAM%   PCIeTX/s      PCIeRX/s      gfx%   (rc per metric)")
    for a0, b0, got in rows:
        if isinstance(got[0], str):
            print(f"[{a0:.3f}, {b0:.3f}]  {got[0]}")
            continue
        vals = "  ".join(f"{v:9.2f}" for _, v in got)
        rcs = ",".join(str(rc) for rc, _ in got)
        print(f"[{a0:.3f}, {b0:.3f}]  {vals}   ({rcs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
