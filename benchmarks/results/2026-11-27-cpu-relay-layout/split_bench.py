"""CPU per row of ``TrackerLayout.split`` (what the W&B sink runs on every row, in the training
process), for rows of 1, 2 and 8 simulated GPUs as the engine finishes them.

    PYTHONPATH=<tree>/src python benchmarks/results/2026-11-27-cpu-relay-layout/split_bench.py

Run against two trees one after the other (``run.sh``); the thread's CPU time over 2,000 splits
of one row, five repetitions, the median and the range printed.
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: tests.*
from gpulens.sinks.layout import TrackerLayout
from tests.test_tracker_layout import _row

for gpus in (1, 2, 8):
    values = _row(gpus)
    layout = TrackerLayout()
    layout.split(values)
    reps = []
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(2000):
            layout.split(values)
        reps.append((time.thread_time() - t0) / 2000 * 1e6)
    print(f"{gpus} GPU(s), {len(values)} keys: {statistics.median(reps):.1f} us a row "
          f"(range {min(reps):.1f}-{max(reps):.1f})")
