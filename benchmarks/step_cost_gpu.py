"""What a running gpulens costs each training step, part by part, under DDP on short steps.

    OUT=/tmp/out python benchmarks/step_cost_gpu.py --gpus 4 --budget-s 240
    OUT=/tmp/out python benchmarks/step_cost_gpu.py --gpus 2 --cpu --budget-s 60   # smoke run

One ``torchrun`` launch of a DDP loop (a stack of linear layers, bf16 autocast; ``small`` is
about 2 ms a step on an H200).  Every round times each arm once, ``--steps`` steps each (the
slowest rank's mean step), in an order shuffled anew each round (the same on every rank):

* ``off`` and ``off_b`` (its A/A arm): no gpulens at all;
* with one ``Monitor`` running (started before the block, its first row waited for, so the
  block is the steady state; start and stop are measured by ``benchmarks/start_stop.py``):

  - ``idle``: the monitor samples, the loop never calls ``log()`` (the engine's own reads);
  - ``float``: ``log(step, loss=<a float>)`` every step (the row path);
  - ``tensor``: ``log(step, loss=loss.detach())`` every step (the copy to host memory, its
    event, the relay thread that polls it);
  - ``tensor_poll05``: the same with the earlier relay, which polled every 0.5 ms.

The off block and the monitor block run in an order shuffled per round.  Each arm is read as
percentage points of the same round's ``off`` step (``benchmarks/paired.py``): mean, 95 %
bootstrap interval, and the A/A envelope.  ``GPULENS_STEP_COST_MONITOR_KW`` (JSON) passes
extra ``Monitor`` arguments (for example ``{"gpm": false}``).  Writes ``step_cost.md`` and
``step_cost.json`` under ``$OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paired

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"small": (1024, 4), "medium": (4096, 4)}
CPU_SIZES = {"small": (64, 2), "medium": (128, 2)}
MONITOR_ARMS = ("idle", "float", "tensor", "tensor_poll05")
OFF_ARMS = ("off", "off_b")


def loop_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import gpulens
    from gpulens.transport import relay

    cuda = not args.cpu
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    width, layers = (SIZES if cuda else CPU_SIZES)[args.size]
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(dev),
        device_ids=[local] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(64, width, device=dev)
    kw: dict[str, Any] = json.loads(os.environ.get("GPULENS_STEP_COST_MONITOR_KW") or "{}")
    out = Path(args.run_dir)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    logged = [0]  # the step count goes on across arms, as in a training run

    def steps(n: int, how: str, mon: Any = None) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            logged[0] += 1
            step = logged[0]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if how == "float":
                mon.log(step, loss=0.5)
            elif how in ("tensor", "tensor_poll05"):
                mon.log(step, loss=loss.detach())
        sync()
        return (time.perf_counter() - t0) / n

    def slowest(t: float) -> float:
        worst = torch.tensor([t], device=dev)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return float(worst.item())

    first, most = relay.POLL_FIRST_S, relay.POLL_MAX_S
    values: dict[str, dict[int, float]] = {a: {} for a in (*OFF_ARMS, *MONITOR_ARMS)}
    steps(30, "off")  # warm up
    deadline = time.monotonic() + args.budget_s
    rnd = 0
    while rnd < args.max_rounds:
        rng = random.Random(rnd)  # the same on every rank
        blocks = ["off", "monitor"]
        rng.shuffle(blocks)
        for block in blocks:
            if block == "off":
                order = list(OFF_ARMS)
                rng.shuffle(order)
                for arm in order:
                    steps(10, "off")
                    values[arm][rnd] = slowest(steps(args.steps, "off"))
                continue
            mon = gpulens.Monitor(interval=0.1, sinks=[f"jsonl:{out / f'rows-r{rnd}.jsonl'}"],
                                  **kw)
            mon.start()
            steps(10, "tensor", mon)
            time.sleep(1.0)  # the engine's start-up (imports, NVML, the energy probe) ends
            dist.barrier()
            order = list(MONITOR_ARMS)
            rng.shuffle(order)
            for arm in order:
                old = arm == "tensor_poll05"
                relay.POLL_FIRST_S = relay.POLL_MAX_S = 0.0005 if old else first
                if not old:
                    relay.POLL_MAX_S = most
                steps(10, arm, mon)
                values[arm][rnd] = slowest(steps(args.steps, arm, mon))
            relay.POLL_FIRST_S, relay.POLL_MAX_S = first, most
            mon.stop()
            dist.barrier()
        rnd += 1
        done = torch.tensor([time.monotonic() >= deadline], device=dev, dtype=torch.int)
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        if done.item():
            break
    if rank == 0:
        (out / "values.json").write_text(json.dumps({"world": world, "values": values}))
    dist.barrier()
    dist.destroy_process_group()


def report(values: dict[str, dict[int, float]], args: argparse.Namespace, world: int,
           device: str) -> str:
    baseline_of = {"off": "off", "off_b": "off", **{a: "off" for a in MONITOR_ARMS}}
    comparisons = paired.compare(values, baseline_of, rivals=[("tensor", "tensor_poll05")])
    rounds = len(values["off"])
    off_ms = sorted(values["off"].values())[rounds // 2] * 1e3 if rounds else float("nan")
    lines = [f"# step_cost_gpu: {world} x {device}, model {args.size}, {args.steps} steps an "
             f"arm, {rounds} rounds; off step (median of rounds) {off_ms:.3f} ms",
             f"monitor kwargs: {os.environ.get('GPULENS_STEP_COST_MONITOR_KW') or '{}'}", "",
             paired.table(comparisons, bound_pp=0.3), ""]
    lines += paired.bias_notes(comparisons)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--steps", type=int, default=200, help="timed steps of each arm a round")
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--max-rounds", type=int, default=60)
    p.add_argument("--cpu", action="store_true", help="gloo and simulated GPUs: a smoke run")
    p.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_dir:
        loop_main(args)
        return 0
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="step-cost-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="step-cost-work-"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    if args.cpu:
        env.update(GPULENS_BACKEND="simulated", GPULENS_SIMULATED_GPUS=str(args.gpus),
                   OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.gpus), str(Path(__file__).resolve()), "--run-dir", str(work), "--size",
           args.size, "--steps", str(args.steps), "--budget-s", str(args.budget_s),
           "--max-rounds", str(args.max_rounds), *(["--cpu"] if args.cpu else [])]
    print(" ".join(cmd), flush=True)
    code = subprocess.call(cmd, env=env, cwd=ROOT, timeout=args.budget_s + 240)
    got = work / "values.json"
    if not got.exists():
        print(f"no figures (torchrun exit {code})")
        return 1
    data = json.loads(got.read_text())
    values = {arm: {int(k): v for k, v in per.items()} for arm, per in data["values"].items()}
    device = "CPU (gloo, simulated GPUs)"
    if not args.cpu:
        import torch

        device = torch.cuda.get_device_name(0)
    text = report(values, args, data["world"], device)
    (out / "step_cost.json").write_text(json.dumps({"args": vars(args), **data}, indent=1))
    (out / "step_cost.md").write_text(text + "\n")
    print(text)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
