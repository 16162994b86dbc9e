"""``torchrun --nproc_per_node 2 tests/support/tune_ddp.py OUT_DIR [STEPS [DELAY_S]]``:
``gpulens.tune.tune`` under DDP on a CPU (gloo). Rank 1 is slower, and its loader slower still:
alone it would need two loader workers at batch 16 where rank 0 needs one. Both ranks run out of
memory at batch 32. Each rank writes ``OUT_DIR/rank<R>.json``: its own figures of every trial
(before the ranks agree) and the result.

``STEPS``: the timed steps of a trial (8). ``DELAY_S``: rank 0's warm-up step of every trial
sleeps this much longer (0), as a slow first step does (``benchmarks/tune_prefetch_lead.py``)."""

from __future__ import annotations

import gc
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from gpulens.tune import Trial, tune
from gpulens.tune import dist as tune_dist
from tests.support.tune_load import ControlledStep, SlowSamples, collate_numpy


class _SlowWarmup:
    """``step`` whose first call of every trial (``1 + steps`` calls; one, raising, for an
    out-of-memory trial) sleeps ``delay_s`` first."""

    def __init__(self, step: ControlledStep, steps: int, delay_s: float) -> None:
        self.step, self.every, self.delay_s = step, 1 + steps, delay_s
        self.calls = 0

    def __call__(self, batch: Any) -> None:
        if self.calls % self.every == 0:
            time.sleep(self.delay_s)
        self.calls += 1
        try:
            self.step(batch)
        except BaseException:
            self.calls = 0
            raise


def main(out: Path, steps: int = 8, delay_s: float = 0.0) -> None:
    # the loader's workers start from a forkserver (torch and this module loaded once there):
    # forked from a rank, which runs gloo's threads and, in tests/support/ddp_scripts.py, the
    # TCPStores and whatever the scripts before left, a worker hung in the full suite now and
    # then (rank 1 waited for its batch, rank 0 in the gradient all-reduce), as fork with
    # threads can; what is tested here is the sweep's agreement, not how workers start
    multiprocessing.set_forkserver_preload(["torch", "tests.support.tune_load"])
    start_method = multiprocessing.get_start_method()
    multiprocessing.set_start_method("forkserver", force=True)
    try:
        _tune(out, steps, delay_s)
    finally:
        multiprocessing.set_start_method(start_method, force=True)


def _tune(out: Path, steps: int, delay_s: float) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    local: list[dict[str, Any]] = []
    agree = tune_dist.agree

    def spy(trial: Trial) -> Trial:
        local.append(trial.to_dict())
        return agree(trial)

    tune_dist.agree = spy
    # eight timed steps by default, not three: a long warm-up step (in CI on 2026-11-28, a
    # loaded machine) lets rank 1's one worker fill its prefetch queue (two batches ready: the
    # loader has at most prefetch_factor x workers outstanding), and three steps then ran on
    # those batches alone: no data wait at batch 16 with one worker, so the sweep kept one
    # worker there.  Eight steps read about 28 % even from a full queue (about 41 % from an
    # empty one), far above the 5 % target (benchmarks/tune_prefetch_lead.py runs both)
    # twice the times this job had until 2026-11-28: the loader's hand-over of a batch from its
    # worker (a few ms on a loaded machine) was 5.3 % of rank 0's 34 ms step at batch 4 in CI,
    # which sent the sweep to two workers before rank 1's loader could fall short alone
    step = ControlledStep(fixed_s=0.06 if rank == 0 else 0.08, per_sample_s=0.002, knee=16,
                          slow_per_sample_s=0.008, oom_at=32)
    step.model = DistributedDataParallel(step.model)
    data = SlowSamples(per_sample_s=0.002 if rank == 0 else 0.012)
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data), drop_last=True,
                        collate_fn=collate_numpy)
    run: Any = _SlowWarmup(step, steps, delay_s) if rank == 0 and delay_s else step
    result = tune(loader, run, model=step.model, optimizer=step.optimizer,
                  batch_sizes=(4, 8, 16, 32), workers=(0, 1, 2), workers_per_cpu=False,
                  warmup_steps=1, steps=steps, progress=rank == 0)
    (out / f"rank{rank}.json").write_text(json.dumps({"local": local,
                                                      "result": result.to_dict()}))
    tune_dist.agree = agree
    # free the DDP model (its Reducer holds the group from C++) before destroying the group, or
    # the group's last reference goes with the model later and gloo's destructor can wait for
    # the GIL it holds (docs/design-notes.md, "DDP exit"; seen here when the script returned
    # to tests/support/ddp_scripts.py; and again on 2026-11-28 when `run`, which is `step` or
    # wraps it, was left holding the model)
    del step, loader, run
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:3]), *(float(a) for a in sys.argv[3:4]))
