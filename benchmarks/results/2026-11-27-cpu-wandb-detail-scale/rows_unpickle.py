"""What reading one row back costs the thread that reads it (now the training thread, in
log()): pickle.loads of a RowOut of 65, 209 and 431 keys (rank 0's JSONL keys at 1, 2 and 8
simulated GPUs, `benchmarks/tracker_keys.py`), median of 2,000.

    cd benchmarks/results/2026-11-27-cpu-wandb-detail-scale && \
        PYTHONPATH=../../../src ../../../.venv/bin/python rows_unpickle.py
"""
import pickle
import statistics
import time

from gpulens.model import Row
from gpulens.transport.messages import RowOut

for keys in (65, 209, 431):
    row = Row(step=1, time=1.0, values={f"gpu/{i % 8}/k{i}": float(i) for i in range(keys)})
    data = pickle.dumps(RowOut(row, True))
    times = []
    for _ in range(2000):
        t = time.perf_counter()
        pickle.loads(data)
        times.append(time.perf_counter() - t)
    print(f"{keys} keys: {len(data)} bytes, loads median {statistics.median(times) * 1e6:.1f} us")
