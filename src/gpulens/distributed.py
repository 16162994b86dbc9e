"""Distributed jobs: the ranks' windows meet on rank 0.

Each rank samples only the GPU it trains on.  At every ``log()`` (a collective) each rank puts
up to ``SLOTS`` finished rows into one fixed-size float tensor and the ranks all-gather it over
a gloo group of gpulens's own (CPU tensors: no CUDA copy, so no device sync on the training
thread, even when training uses NCCL).  Rows are matched by their sequence number (the k-th
``log()`` call of every rank), so ranks that finish rows at different moments still line up.
Rank 0 writes the merged row: every GPU of the job keyed by global rank, plus
``gpu/all/<metric>_mean|_min|_max``.

Tensor layout, ``(SLOTS + 1) x width`` float64::

    row 0:          [rows still pending after this send, 0, ...]
    rows 1..SLOTS:  [valid, seq, gpu key, host cpu_pct, host ram_used_gb, *GPU_ROW_KEYS]
                    (NaN where a metric is not available)
"""

from __future__ import annotations

import math
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from gpulens.engine.window import job_aggregates
from gpulens.schema import GPU_ROW_KEYS, HOST_KEYS, gpu_key
from gpulens.sinks.base import Row, RunContext

SLOTS = 4
_HEAD = 5  # valid, seq, gpu key, host cpu, host ram
WIDTH = _HEAD + len(GPU_ROW_KEYS)


def torch_distributed_ready() -> bool:
    """Whether torch.distributed is initialised with more than one rank (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    dist = getattr(torch, "distributed", None)
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized()
                    and dist.get_world_size() > 1)
    except Exception:
        return False


class RankGather:
    """Collects this rank's rows and exchanges them with the other ranks (see module doc)."""

    def __init__(self, context: RunContext | None, submit: Callable[[Row], None]) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.is_writer = self.rank == 0
        # gpulens's own gloo group: CPU tensors, never a CUDA copy or sync.
        self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self._gpu_key = self.rank
        if context is not None:
            self.bind(context)
        self._submit = submit
        self._pending: deque[Row] = deque()
        self._lock = threading.Lock()
        self._seq_out = 0
        self._own: dict[int, Row] = {}
        self._parts: dict[int, dict[int, list[float]]] = {}
        self._next_write = 0

    def bind(self, context: RunContext) -> None:
        """Learn this rank's GPU key (when the context comes after the gather is made)."""
        self._gpu_key = context.gpus[0].index if context.gpus else self.rank

    def local_row(self, row: Row) -> None:
        """Called by the sampler thread with each finished row of this rank, in order."""
        with self._lock:
            self._pending.append(row)

    def _pack(self) -> Any:
        torch = self._torch
        buf = torch.full((SLOTS + 1, WIDTH), math.nan, dtype=torch.float64)
        buf[0].zero_()
        with self._lock:
            take = [self._pending.popleft() for _ in range(min(SLOTS, len(self._pending)))]
            remaining = len(self._pending)
        buf[0, 0] = float(remaining)
        for i, row in enumerate(take, start=1):
            seq = self._seq_out
            self._seq_out += 1
            values = [1.0, float(seq), float(self._gpu_key)]
            values += [row.values.get(f"host/{k}", math.nan) for k in HOST_KEYS]
            values += [row.values.get(gpu_key(self._gpu_key, s), math.nan) for s in GPU_ROW_KEYS]
            buf[i] = torch.tensor(values, dtype=torch.float64)
            if self.is_writer:
                self._own[seq] = row
        return buf

    def exchange(self) -> int:
        """One all-gather; rank 0 writes every row that all ranks have sent.  Returns the
        largest number of rows any rank still holds."""
        buf = self._pack()
        out = [self._torch.empty_like(buf) for _ in range(self.world)]
        self._dist.all_gather(out, buf, group=self._group)
        remaining = 0
        for rank, got in enumerate(out):
            remaining = max(remaining, int(got[0, 0].item()))
            if not self.is_writer:
                continue
            for slot in got[1:].tolist():
                if slot[0] != 1.0:
                    continue
                self._parts.setdefault(int(slot[1]), {})[rank] = slot
        if self.is_writer:
            self._write_ready()
        return remaining

    def _write_ready(self) -> None:
        while self._next_write in self._parts and len(self._parts[self._next_write]) == self.world:
            seq = self._next_write
            parts = self._parts.pop(seq)
            own = self._own.pop(seq)
            self._next_write += 1
            values = {k: v for k, v in own.values.items() if not k.startswith("gpu/")}
            per_gpu: list[dict[str, float]] = []
            for rank in sorted(parts):
                slot = parts[rank]
                key = int(slot[2])
                gpu = {s: v for s, v in zip(GPU_ROW_KEYS, slot[_HEAD:], strict=True)
                       if not math.isnan(v)}
                for suffix, value in gpu.items():
                    values[gpu_key(key, suffix)] = value
                if gpu:
                    per_gpu.append(gpu)
            values.update(job_aggregates(per_gpu))
            energies = [g["energy_j"] for g in per_gpu if "energy_j" in g]
            steps = values.get("perf/steps", 1.0) or 1.0
            if energies:
                values["perf/energy_per_step_j"] = sum(energies) / steps
            self._submit(Row(step=own.step, time=own.time, values=values))

    def flush(self) -> None:
        """At stop (a collective too): exchange until no rank holds a row."""
        for _ in range(100_000):
            if self.exchange() == 0:
                with self._lock:
                    if not self._pending:
                        break
        self._own.clear()
        self._parts.clear()
