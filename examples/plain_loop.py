"""A plain PyTorch loop with GPU telemetry in the same row as loss, learning rate and grad norm.

    python examples/plain_loop.py --out runs/plain.jsonl
    torchrun --nproc_per_node 2 examples/plain_loop.py --out runs/ddp.jsonl   # DDP, gloo on CPU

Every ``--log-every`` steps, ``monitor.log(step, loss=..., ...)`` writes one row: the GPU window
since the previous log, host metrics, the step phases (``perf/data_wait_pct`` ...) and the
scalars. Under torchrun each rank samples its own GPU, every rank calls ``log`` (a collective)
and rank 0 writes rows holding every rank's GPU (``gpu/0/...``, ``gpu/1/...``, ``gpu/all/...``).
Without a GPU the monitor samples simulated GPUs, one per rank.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gpulens
from gpulens.integrations.phases import StepPhases


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSONL file for the rows (default: temp folder)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--interval", type=float, default=0.05, help="seconds between GPU samples")
    p.add_argument("--tokens-per-step", type=int, default=None,
                   help="tell gpulens this much work per step (rows then carry "
                        "perf/tokens_per_s and perf/tokens_per_j)")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("GPULENS_BACKEND", "simulated")
        # one simulated GPU per process of the node (torchrun sets LOCAL_WORLD_SIZE)
        os.environ.setdefault("GPULENS_SIMULATED_GPUS", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # the monitor's engine process gets ready while the model and data are built: start()
    # below then takes it (0.05 s instead of 0.3-0.4 s on an H200 host: gpulens's
    # benchmarks/results/2026-11-28-h200-start-spare)
    gpulens.setup()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1)).to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    gen = torch.Generator().manual_seed(rank)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 32, generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True, generator=gen)

    out = Path(args.out or Path(tempfile.mkdtemp(prefix="gpulens-plain-")) / "rows.jsonl")
    phases = StepPhases(cuda=cuda)
    # Created after init_process_group: the monitor then gathers the ranks' windows on rank 0.
    with gpulens.Monitor(interval=args.interval, sinks=[f"jsonl:{out}"]) as monitor:
        batches = iter(loader)
        phases.resume()
        for step in range(1, args.steps + 1):
            try:
                (x,) = next(batches)
            except StopIteration:
                batches = iter(loader)
                (x,) = next(batches)
            x = x.to(device, non_blocking=True)
            phases.step_begin()
            loss = nn.functional.mse_loss(model(x).squeeze(-1), x[:, :4].sum(-1))
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            phases.before_optimizer()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            phases.step_end()
            if step % args.log_every == 0:
                # .item() syncs once per log, as any loss print would; every rank calls log()
                work = ({"tokens": args.tokens_per_step * args.log_every}
                        if args.tokens_per_step else {})
                monitor.log(step, loss=loss.item(), learning_rate=sched.get_last_lr()[0],
                            grad_norm=grad_norm.item(), **work, **phases.collect(args.log_every))
                phases.resume()
    if rank == 0:
        print(f"gpulens: {args.steps // args.log_every} rows in {out}")
    if distributed:
        # free the DDP model (its Reducer holds the group from C++) before destroying the
        # group, so that gloo's threads are joined with the GIL let go (docs/design-notes.md,
        # "DDP exit")
        del model
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
