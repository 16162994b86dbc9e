"""How long one launch takes the calling thread with N matrix products queued ahead of it (the
command of depth_probe.md; run on the device with torch, no gpulens)."""

import statistics
import time

import torch

torch.cuda.init()
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
x = torch.zeros(16, device="cuda")
s = torch.cuda.current_stream()
ev_t = torch.cuda.Event(enable_timing=True)
ev_n = torch.cuda.Event()
for _ in range(5):
    a @ a
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(20):
    a @ a
torch.cuda.synchronize()
per = (time.perf_counter() - t0) / 20
print(f"matmul {per * 1e6:.0f} us")
probes = {"record timing ev (stream given)": lambda: ev_t.record(s),
          "record plain ev (stream given)": lambda: ev_n.record(s),
          "tiny kernel x.add_(1)": lambda: x.add_(1),
          "new timing ev + record": lambda: torch.cuda.Event(enable_timing=True).record(s)}
print("| pending matmuls | " + " | ".join(probes) + " |")
for depth in (0, 1, 4, 16, 64, 256):
    row = []
    for fn in probes.values():
        vals = []
        for _ in range(9):
            torch.cuda.synchronize()
            for _ in range(depth):
                a @ a
            t0 = time.perf_counter()
            fn()
            vals.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        row.append(f"{statistics.median(vals):.1f}")
    print(f"| {depth} | " + " | ".join(row) + " |")
