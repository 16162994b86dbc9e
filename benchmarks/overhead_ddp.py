"""DDP overhead of gpulens's Hugging Face callback, with an A/A arm (issue 11, path (d)).

Run under torchrun, one process per GPU (NCCL), or on CPUs with gloo (``--quick``)::

    torchrun --nproc-per-node 2 benchmarks/overhead_ddp.py --budget-s 420     # 2 GPUs
    torchrun --nproc-per-node 2 benchmarks/overhead_ddp.py --quick            # CPU smoke run

Every rank trains the GPT-2-small-sized model of ``overhead_gpu.py`` (bf16, built from a config)
in a Hugging Face ``Trainer`` (DDP over the job's process group, ``report_to=["wandb"]``
offline: rank 0's run). For each ``logging_steps`` value in ``--log-steps`` (1 and 10) there are
three arms: ``hf_ls<N>`` (the baseline), ``hf_ls<N>_b`` (its A/A arm) and ``hf_ls<N>_gpulens``
(with ``GPUMonitorCallback(interval)``: each rank samples its GPU in its own engine process, and
every ``log()`` is an all-gather over gpulens's gloo group on the training thread). Rounds,
shuffled order (the same on every rank: seeded), pilot rule, verdicts and report are those of
``overhead_gpu.py`` / ``paired.py``. An arm is timed as a block on every rank (a device sync at
its two ends); its value in a round is the slowest rank's mean step. Rank 0 decides when to stop
and tells the others over a gloo group of this script's own.

Writes ``$OUT/overhead_ddp.json`` (or ``--json``) after every round; prints Markdown at the end
(rank 0).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead_gpu as og  # benchmarks/overhead_gpu.py, beside this script
import paired


def arms_for(log_steps: list[int]) -> tuple[list[str], dict[str, str], list[tuple[str, str]]]:
    """Arm names, each arm's baseline, and the gpulens arms to set against each other."""
    names: list[str] = []
    base_of: dict[str, str] = {}
    rivals: list[tuple[str, str]] = []
    for n in log_steps:
        base = f"hf_ls{n}"
        for a in (base, paired.aa_name(base), f"{base}_gpulens"):
            names.append(a)
            base_of[a] = base
    return names, base_of, rivals


def log_steps_of(name: str) -> int:
    """``hf_ls10_gpulens`` -> 10."""
    return int(name.split("_")[1][2:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU (gloo), tiny model, simulated GPUs")
    p.add_argument("--log-steps", default="1,10", help="logging_steps values, comma-separated")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--pilot", type=int, default=4)
    p.add_argument("--max-rounds", type=int, default=60)
    p.add_argument("--resolve-pp", type=float, default=paired.RESOLVE_PP)
    p.add_argument("--steps", type=int, default=None, help="timed steps per arm")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--target-ms", type=float, default=100.0)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.log_every = 1  # unused: each arm names its own logging_steps
    og.quiet_libraries()
    t_begin = time.perf_counter()
    if "RANK" not in os.environ:
        print("overhead_ddp.py: run it under torchrun (see the module doc)", file=sys.stderr)
        return 2
    if args.quick:
        os.environ["GPULENS_BACKEND"] = "simulated"
        os.environ.setdefault("GPULENS_SIMULATED_GPUS", os.environ.get("LOCAL_WORLD_SIZE", "2"))
    import torch
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and not args.quick
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    ctrl = dist.new_group(backend="gloo")

    def agree(x: Any) -> Any:
        """Rank 0's ``x``, on every rank."""
        box = [x]
        dist.broadcast_object_list(box, src=0, group=ctrl)
        return box[0]

    def gather(x: Any) -> list[Any]:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, x, group=ctrl)
        return out

    steps = args.steps or (6 if args.quick else 40)
    warmup = max(1, args.warmup or (2 if args.quick else 5))
    log_steps = [int(x) for x in args.log_steps.split(",") if x.strip()]
    names, base_of, rivals = arms_for(log_steps)
    out = args.json or (Path(os.environ["OUT"]) / "overhead_ddp.json" if os.environ.get("OUT")
                        else None)
    device = f"cuda:{local}" if cuda else "cpu"
    # rank 0 chooses the batch for ~target_ms a (single-GPU) step; every rank uses it
    if rank == 0:
        s = og.setup(args.quick, args.target_ms, args.batch, args.seq, device)
        agree(s.batch_size)
    else:
        s = og.setup(args.quick, args.target_ms, agree(None), args.seq, device)
    s.optimizer = None  # the plain loop's optimizer is not used here: free its state
    gc.collect()
    training_threads = set(og.Probe.take().threads)
    tmpdir = tempfile.TemporaryDirectory(prefix=f"gpulens-ddp-{rank}-")
    tmp = Path(tmpdir.name)
    why = og.missing("wandb") or og.missing("transformers")
    runner = og.HfRunner(tmp, s, args) if why is None else None
    arms: dict[str, og.Arm] = {
        n: og.HfArm(n, runner, why, n.endswith("_gpulens"), None, log_steps_of(n)) for n in names
    }
    run = og.Run(args, names, {n: og.Result(n) for n in names}, base_of, tuple(rivals))
    for n, a in arms.items():
        run.results[n].skipped = a.skip_reason()
    run.meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": og.git_commit(),
        "quick": args.quick, "suites": [f"ddp x{world}"], "arms": names,
        "hardware": og.hardware(s), "versions": og.versions(), "world_size": world,
        "backend": dist.get_backend(),
        "model": {"n_params": s.n_params, "n_layer": s.config.n_layer, "n_embd": s.config.n_embd,
                  "seq_len": s.seq_len, "batch": s.batch_size, "dtype": "bfloat16"},
        "interval_s": args.interval, "log_every": ",".join(map(str, log_steps)), "steps": steps,
        "warmup": warmup, "seed": args.seed, "budget_s": args.budget_s,
        "command": " ".join([sys.executable, *sys.argv]),
    }

    def combine(rep: og.Rep) -> og.Rep:
        """The slowest rank's value; the others' in the note."""
        values = gather(rep.value_s)
        rep.value_s = max(values)
        rep.note += "; per rank ms/step: " + ", ".join(f"{v * 1e3:.2f}" for v in values)
        return rep

    og.run_rounds(run, arms, warmup, steps, training_threads, t_begin, out, agree=agree,
                  combine=combine, writer=rank == 0, raise_on_failure=True)
    dist.barrier(group=ctrl)
    tmpdir.cleanup()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
