"""``torchrun --nproc_per_node 2 tests/support/slow_rank_ddp.py OUT STEPS``: a DDP job (gloo, CPU)
whose rank 1 turns slow in backward compute after :data:`SLOW_RANK_AFTER` steps, for the
``slow_rank`` rule on CPU ranks (``tests/test_integration_distributed.py``).

Rank 1 burns more CPU in backward from step SLOW_RANK_AFTER on; the all-reduce makes every
rank's wall-clock step equal.  gpulens adds each rank's CPU seconds per step
(``rank/{r}/cpu_busy_s``) to the merged rows and its engine runs the rules on them.  The
simulated GPUs have no GPM: a CPU job's GPUs do none of its work, so the rule judges the ranks
by their CPU time.  Rank 0 writes the rows and the engine's verdicts to the JSONL file OUT.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

SLOW_RANK_AFTER = 30
STEPS = SLOW_RANK_AFTER + 30


def worker(out: str, steps: int) -> None:
    """One rank of the job (module doc)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import gpulens
    from gpulens.testing import Constant, SimulatedNVML

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    slow = {"on": False}

    class SlowBackward(torch.autograd.Function):
        """Identity forward; in backward, matrix products: 4x as many on rank 1 once slow."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            # every rank does some work of its own in backward, so that a step's CPU time is
            # mostly compute and not the few milliseconds a loaded machine jitters by; rank 1
            # then does 4x as much (its CPU time per step ~2.5x the other's, with the forward:
            # a lag well past the rule's 50 %, and past the ~30 % a loaded host jitters by)
            a = torch.randn(256, 256)
            for _ in range(40 if rank == 1 and slow["on"] else 10):
                a = a @ a
                a = a / a.norm()
            return grad

    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # the node's two GPUs, one a rank (one GPU on both would be one GPU watched twice)
    sim = SimulatedNVML(gpus=2, gpm=False, load=Constant(0.6))
    with gpulens.Monitor(interval=0.05, sinks=[f"jsonl:{out}"], backend=sim) as mon:
        for step in range(1, steps + 1):
            slow["on"] = step > SLOW_RANK_AFTER
            y = SlowBackward.apply(model(torch.randn(2048, 64)))  # type: ignore[no-untyped-call]
            loss = y.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(step, loss=loss.item())
    # free the DDP model before destroying the group (docs/design-notes.md, "DDP exit")
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
