"""DDP: every rank runs every trial; the ranks agree on its figures before the sweep decides.

After each trial every rank calls :func:`agree` (two ``all_reduce`` calls of a few numbers, on
the default process group: MIN for the rates, MAX for the data wait, step time and memory).
The agreed trial has

* the **slowest rank's** rates, times the world size (samples/s, tokens/s of the job: in a
  synchronous DDP step every rank waits for the slowest), TFLOP/s and MFU per GPU of that rank;
* the **largest** data wait, phase times and step time of any rank (the wait is ``loader
  pace`` when any rank's came from its loader's pace), and the slowest loader worker's time per
  batch;
* the **fullest GPU's** peak memory (and the smallest headroom), the most allocator retries;
* ``oom`` when any rank ran out of memory, ``failed`` when any could not time the trial.

The sweep's decisions are functions of these agreed figures only (its time budget counts the
agreed trial times), so every rank measures the same configurations in the same order and
ends with the same choice.

A limit that no tuner removes: an out-of-memory error on *some* ranks in the middle of a DDP
step leaves the others waiting in that step's gradient all-reduce (as in any DDP job). The
out-of-memory edge is found without a hang when the ranks run the same model on equal GPUs
(they run out of memory at the same batch size, in the same step).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gpulens.tune.model import Trial

_MIN_RATES = ("samples_per_s", "tokens_per_s", "tflops", "mfu_pct", "headroom_gb")
_MAX_FIGURES = ("data_wait_pct", "forward_backward_pct", "optimizer_pct", "data_wait_s",
                "forward_backward_s", "optimizer_s", "step_s", "seconds", "wall_s",
                "peak_allocated_gb", "peak_reserved_gb", "total_gb", "alloc_retries",
                "loader_batch_s")
_JOB_RATES = ("samples_per_s", "tokens_per_s")
_STATUS = {"ok": 0.0, "failed": 1.0, "oom": 2.0}
_WAIT_BY = {"window": 0.0, "loader pace": 1.0}


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group, ``(0, 1)`` without one."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def agree(trial: Trial) -> Trial:
    """The trial as every rank agrees on it (module docstring); the trial itself without a
    process group or with one rank."""
    _rank, size = world()
    if size == 1:
        return trial
    import torch
    import torch.distributed as dist

    device = _device()
    lows = [_value(trial, k, math.inf) for k in _MIN_RATES]
    highs = [_value(trial, k, -math.inf) for k in _MAX_FIGURES]
    highs.append(-math.inf if trial.data_wait_by is None else _WAIT_BY[trial.data_wait_by])
    highs.append(_STATUS[trial.status])
    low_t = torch.tensor(lows, dtype=torch.float64, device=device)
    high_t = torch.tensor(highs, dtype=torch.float64, device=device)
    dist.all_reduce(low_t, op=dist.ReduceOp.MIN)
    dist.all_reduce(high_t, op=dist.ReduceOp.MAX)
    values: dict[str, Any] = {}
    for key, v in zip(_MIN_RATES, low_t.tolist(), strict=True):
        values[key] = None if math.isinf(v) else v * (size if key in _JOB_RATES else 1)
    high = high_t.tolist()
    for key, v in zip(_MAX_FIGURES, high, strict=False):
        values[key] = None if math.isinf(v) else v
    by = high[-2]
    values["data_wait_by"] = None if math.isinf(by) else next(
        name for name, code in _WAIT_BY.items() if code == by)
    if values["alloc_retries"] is not None:
        values["alloc_retries"] = int(values["alloc_retries"])
    status = next(s for s, code in _STATUS.items() if code == high[-1])
    if status != "ok":
        values.update({k: None for k in _MIN_RATES})
    return dataclasses.replace(trial, status=status, world_size=size,  # type: ignore[arg-type]
                               error=trial.error or (None if status == "ok" else
                                                     f"{status} on another rank"),
                               **values)


def _device() -> Any:
    """Where the default group's collectives take their tensors: the current CUDA device for
    NCCL, the host otherwise (gloo)."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return "cpu"


def _value(trial: Trial, key: str, absent: float) -> float:
    v = getattr(trial, key)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return absent
    return float(v)


def agree_min(value: int | None) -> int | None:
    """The smallest ``value`` over the ranks (``None`` counts as no limit; ``None`` when no
    rank has one): e.g. the CPUs per rank, so every rank sweeps the same worker counts."""
    _rank, size = world()
    if size == 1:
        return value
    import torch
    import torch.distributed as dist

    device = _device()
    big = 2**62
    t = torch.tensor([big if value is None else value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    low = int(t.item())
    return None if low == big else low
