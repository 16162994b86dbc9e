"""Distributed jobs: the ranks' windows meet on rank 0.

Each rank samples only the GPU it trains on.  Every ``log()`` (a collective) asks for one
exchange and returns: a thread of gpulens's own on each rank (``gpulens-gather``) makes the
exchanges, in order, one per ``log()``, so every rank makes the same number.  In each, the rank
puts up to ``SLOTS`` finished rows into one fixed-size float tensor and the ranks all-gather it
over a gloo group of gpulens's own (CPU tensors: no CUDA copy, so no device sync, even when
training uses NCCL).  The training thread never waits on that network: a rank that reaches its
``log()`` early goes on training, and its exchange waits for the others in the gather thread
(measured: an HF DDP run on 2 H200s logging every step was +2.46 pp slower with gpulens while
the all-gather ran inside ``log()``, +1.03 pp and not separable from the A/A arm after;
``benchmarks/results/2026-11-26-h200x2-*``).  Rows are matched by their sequence number (the k-th
row of every rank, one per ``log()``), so ranks that finish rows at different moments still
line up.
Rank 0 hands the merged row to its engine to be finished and written: every GPU of the job
keyed by global rank, plus ``gpu/all/<metric>_mean|_min|_max``; the work the ranks reported
(tokens, samples, FLOPs) summed over the job, and each rank's CPU seconds per step as
``rank/{r}/cpu_busy_s``.

The gloo group is gpulens's own even when training uses gloo, and :meth:`RankGather.close`
(at ``stop()``, and at interpreter exit if ``stop()`` never ran) destroys it: gpulens leaves no
work of its own in the training's group, and its group is torn down while the interpreter is
alive, through the Python object whose destructor lets go of the GIL before it joins gloo's
worker threads. Why that matters (a gloo worker that must take the GIL to drop the last
collective's tensors, and a process group destroyed by a C++ owner with the GIL held, such as
DDP's ``Reducer``): ``docs/design-notes.md``, "DDP exit".

Tensor layout, ``(SLOTS + 1) x width`` float64::

    row 0:          [rows still pending after this send, 0, ...]
    rows 1..SLOTS:  [valid, seq, gpu key, host cpu_pct, host ram_used_gb,
                     work/tokens, work/samples, work/flops, work/cpu_s, *GPU_ROW_KEYS]
                    (NaN where a figure is not available)
"""

from __future__ import annotations

import math
import os
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from gpulens.engine.spec import WORK_CPU, WORK_FLOPS, WORK_SAMPLES, WORK_TOKENS
from gpulens.engine.window import job_aggregates
from gpulens.log import logger, warn_once
from gpulens.model import Row, RunContext
from gpulens.schema import GPU_ROW_KEYS, HOST_KEYS, gpu_key

SLOTS = 4
_WORK = (WORK_TOKENS, WORK_SAMPLES, WORK_FLOPS, WORK_CPU)
_HEAD = 5 + len(_WORK)  # valid, seq, gpu key, host cpu, host ram, work
WIDTH = _HEAD + len(GPU_ROW_KEYS)
_SUMMED = (WORK_TOKENS, WORK_SAMPLES, WORK_FLOPS)


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
        # gpulens's own gloo group (a collective: every rank makes it here, in start()): CPU
        # tensors, never a CUDA copy or sync; never a work of gpulens's in the training's group.
        self._group: Any = dist.new_group(backend="gloo")
        self._closed = False
        self._late_rows = 0
        # at interpreter exit, if close() never ran: while the interpreter is whole
        self._finalizer: weakref.finalize[Any, Any] = weakref.finalize(
            self, _release_group, dist, self._group, os.getpid())
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
        self._wake = threading.Condition()
        self._asked = 0
        """Exchanges asked for (one per ``log()``); :attr:`_done` of them made."""
        self._done = 0
        self._finishing = False
        self._broken = False
        # started here, in start(), so that no log() pays for a thread start
        self._worker = threading.Thread(
            target=self._work, name="gpulens-gather", daemon=True)
        self._worker.start()

    def bind(self, context: RunContext) -> None:
        """Learn this rank's GPU key (when the context comes after the gather is made)."""
        self._gpu_key = context.gpus[0].index if context.gpus else self.rank

    def local_row(self, row: Row) -> None:
        """Called by the sampler thread with each finished row of this rank, in order.  After
        :meth:`close` a row can no longer be sent: it is counted and warned about."""
        with self._lock:
            if not self._closed:
                self._pending.append(row)
                return
            self._late_rows += 1
        warn_once("gather-late", "gpulens: a row of rank %d came after the ranks' last "
                  "exchange at stop and is not written (counted in late_rows)", self.rank)

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
            values += [row.values.get(k, math.nan) for k in _WORK]
            values += [row.values.get(gpu_key(self._gpu_key, s), math.nan) for s in GPU_ROW_KEYS]
            buf[i] = torch.tensor(values, dtype=torch.float64)
            if self.is_writer:
                self._own[seq] = row
        return buf

    def request(self) -> None:
        """One exchange for this ``log()`` (the training thread): counted and handed to the
        gather thread; never waits for another rank."""
        with self._wake:
            if self._closed or self._broken:
                return
            self._asked += 1
            self._wake.notify()

    def _work(self) -> None:
        """The gather thread: the exchanges asked for, in order; at :meth:`flush`, the last."""
        try:
            while True:
                with self._wake:
                    while (self._done >= self._asked and not self._finishing
                           and not self._closed):
                        self._wake.wait()
                    if self._closed:
                        return
                    if self._done >= self._asked:  # finishing, every asked exchange made
                        break
                self.exchange()
                with self._wake:
                    self._done += 1
            self._last_exchanges()
        except Exception as exc:  # another rank gone, the group torn down under it, ...
            with self._wake:
                self._broken = True
            if not self._closed:
                logger.warning("gpulens: rank %d's exchange of rows with the other ranks "
                               "failed (%r); this job's rows are no longer written", self.rank,
                               exc)

    def _last_exchanges(self) -> None:
        """Exchange until no rank holds a row: every rank leaves at the same exchange."""
        for _ in range(100_000):
            if self.exchange() == 0:
                break

    def exchange(self) -> int:
        """One all-gather; rank 0 writes every row that all ranks have sent.  Returns the
        largest number of rows any rank still holds (the same number on every rank).  After
        :meth:`close` it does nothing and returns 0.  A collective on gpulens's group: the
        gather thread makes them (:meth:`request`)."""
        if self._closed:
            return 0
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
            values = {k: v for k, v in own.values.items()
                      if not k.startswith("gpu/") and k not in _WORK}
            steps = values.get("perf/steps", 1.0) or 1.0
            per_gpu: list[dict[str, float]] = []
            work: dict[str, float] = {}
            for rank in sorted(parts):
                slot = parts[rank]
                key = int(slot[2])
                for name, value in zip(_WORK, slot[5:_HEAD], strict=True):
                    if math.isnan(value):
                        continue
                    if name == WORK_CPU:
                        values[f"rank/{rank}/cpu_busy_s"] = value / steps
                    else:
                        work[name] = work.get(name, 0.0) + value
                gpu = {s: v for s, v in zip(GPU_ROW_KEYS, slot[_HEAD:], strict=True)
                       if not math.isnan(v)}
                for suffix, value in gpu.items():
                    values[gpu_key(key, suffix)] = value
                if gpu:
                    per_gpu.append(gpu)
            values.update(job_aggregates(per_gpu))
            values.update(work)  # the job's work, for the engine to finish into perf/*
            energies = [g["energy_j"] for g in per_gpu if "energy_j" in g]
            if energies:
                values["perf/energy_per_step_j"] = sum(energies) / steps
            self._submit(Row(step=own.step, time=own.time, values=values))

    def flush(self, timeout: float | None = None) -> None:
        """At stop (a collective too): the exchanges still asked for, then exchanges until no
        rank holds a row, then :meth:`close`.  Waits at most ``timeout`` seconds (``None``: as
        long as it takes) for the gather thread.

        Every rank leaves the loop at the same exchange (the one where the largest backlog of
        any rank is 0), so no rank is left alone in an all-gather.  A row that reaches this rank
        after that exchange cannot be sent any more: it is counted and warned about."""
        try:
            with self._wake:
                self._finishing = True
                self._wake.notify()
            self._worker.join(timeout)
            if self._worker.is_alive():
                logger.warning("gpulens: rank %d's last rows did not meet the other ranks' "
                               "within %.0f s (a rank that never reached stop()?); they are "
                               "not written", self.rank, timeout or 0.0)
        finally:
            if not self._worker.is_alive():
                self._own.clear()
                self._parts.clear()
            self.close()

    def close(self) -> None:
        """Release gpulens's gloo group: unregister it from ``torch.distributed`` and drop the
        last reference to it, so its worker threads are joined now (with the GIL let go), not
        by whichever object happens to be freed last.  Not a collective; idempotent; safe after
        ``destroy_process_group()`` has already taken the group down with the default one.
        After it, :meth:`exchange` and :meth:`request` do nothing; the gather thread ends (one
        still inside an all-gather, waiting for a rank that will not come, is left to the
        process's exit with the group: said)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            late = len(self._pending)
            self._pending.clear()
        with self._wake:
            self._wake.notify()
        worker = self._worker
        if late:
            self._late_rows += late
            logger.warning("gpulens: %d row(s) of rank %d came after the last exchange at "
                           "stop and were not written", late, self.rank)
        if worker is not threading.current_thread():
            worker.join(1.0)  # an idle gather thread ends at once
            if worker.is_alive():
                # inside an all-gather that waits for a rank that will not come: tearing the
                # group down under it could hang this process; the group goes with the process
                self._finalizer.detach()
                self._group = None
                logger.warning("gpulens: rank %d's gather thread still waits for another rank; "
                               "gpulens's gloo group is left to the process's exit", self.rank)
                return
        self._finalizer()  # calls _release_group once
        self._group = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (the group is released)."""
        return self._closed

    @property
    def late_rows(self) -> int:
        """Rows of this rank that came after the last exchange at stop (not written)."""
        return self._late_rows


def _release_group(dist: Any, group: Any, pid: int) -> None:
    """Destroy gpulens's group in the process that made it (a forked child leaves it alone)."""
    if os.getpid() != pid:
        return
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)
    except ValueError:
        pass  # already gone: destroy_process_group() of the default group took it down
    except Exception as exc:
        logger.warning("gpulens: releasing gpulens's gloo group failed: %r", exc)
