"""The gpulens arm's counted steps over its median + 5 ms, with their block position and split.

Usage (from this folder): python3 slow_steps.py c*/g0/r*/paths_aa.json > slow_steps.md
"""
import glob, json, statistics as st, sys
from collections import Counter

pos: Counter = Counter()
print("| run | round | counted position | over median (ms) | gap (ms) | busy (ms) | training-thread CPU (ms) |")
print("|---|---|---|---|---|---|---|")
for f in sys.argv[1:]:
    steps = json.load(open(f))["paths"]["hf_ls1"]["steps_rank0"]["hf_ls1_gpulens"]
    med = st.median(m for r in steps.values() for m in r["ms"])
    for rnd, v in steps.items():
        for i, ms in enumerate(v["ms"]):
            if ms > med + 5:
                pos[i] += 1
                print(f"| {f} | {rnd} | {i} | {ms - med:+.1f} | {v['gap_ms'][i]:.2f} | "
                      f"{v['busy_ms'][i]:.1f} | {v['cpu_ms'][i]:.1f} |")
print()
print("by counted position:", dict(sorted(pos.items())))
