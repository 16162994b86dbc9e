"""gpulens on a 4-GPU host under DDP (issue 17): rows, topology, hangs, overhead, NVLink.

    OUT=/tmp/out python benchmarks/scale_gpu.py --gpus 4 --budget-s 510

One command, under 9 minutes on 4 H100s (each part has a time limit of its own; a part that
runs out is reported, the others still run), writing under ``$OUT``: ``scale_gpu.md`` (the
summary), ``scale_gpu.json`` (every figure), ``runs.log`` (each launch's command, exit, seconds
and output tail) and ``rows.tar.gz`` (every JSONL record).  Parts:

1. **runs**: ``examples/hf_trainer.py`` (Hugging Face Trainer, DDP over NCCL) and
   ``examples/lightning_fit.py`` (Lightning DDP) under ``torchrun --nproc-per-node 4``, 5
   launches each: each must exit 0 within its limit (no hang in 10 runs), leave one record (one
   writer: rank 0's ``gpulens.jsonl``, no node file in a job of 4), and its rows must hold every
   rank's GPU (``gpu/0..3/util_pct``, ``job/ranks == 4``) and ``run_start`` every GPU with a
   distinct UUID, its rank and its node (node name = the host).
2. **overhead**: one launch of a DDP loop (a stack of linear layers, bf16 autocast) that times
   rounds of 3 arms in shuffled order: ``base``, ``base_b`` (the A/A arm: the same thing
   again) and ``gpulens`` (a ``Monitor`` logging every step, sinks JSONL).  The verdict reads
   ``gpulens - base`` against the A/A spread ``|base_b - base|``.
3. **nvlink**: the same loop at two model sizes and two DDP ``bucket_cap_mb`` values, gpulens
   logging every step: NVLink (and PCIe) bytes per step per GPU from the rows
   (``(nvlink_rx + nvlink_tx) GB/s x step time``) against the gradient bytes the ring
   all-reduce moves per GPU (``2 (W-1)/W x`` parameters x 4 bytes, fp32 gradients).  They
   should grow together with the model; on one GPU NVLink reads 0 (``--gpus 1``).

Needs torch with CUDA, transformers, lightning, nvidia-ml-py (the device machines have them).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SIZES = {"small": (1024, 4), "large": (4096, 8)}
"""Loop model: (width, layers) of the linear stack (small ~4 M parameters, large ~134 M)."""
CPU_SIZES = {"small": (64, 2), "large": (256, 2)}
"""The same on CPUs (``--cpu``: a smoke run)."""


# -- the loop (run under torchrun) ---------------------------------------------------------------
def loop_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import gpulens

    cuda = not args.cpu
    if not cuda:
        SIZES.update(CPU_SIZES)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
    out = Path(args.run_dir)
    results: dict[str, Any] = {"rank": rank, "world": world}

    def make(size: str, bucket: float) -> tuple[nn.Module, int]:
        width, layers = SIZES[size]
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(dev)
        params = sum(p.numel() for p in model.parameters())
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[local] if cuda else None, bucket_cap_mb=bucket), params

    def steps(model: nn.Module, n: int, mon: Any = None) -> float:
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        x = torch.randn(64, next(model.parameters()).shape[1], device=dev)
        sync()
        t0 = time.perf_counter()
        for step in range(1, n + 1):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if mon is not None:
                mon.log(step, loss=loss.detach())
        sync()
        return (time.perf_counter() - t0) / n

    if args.part == "overhead":
        model, _ = make(args.size_for_overhead, 25.0)
        steps(model, 20)  # warm up
        rng = random.Random(0)  # the same order on every rank
        arms: dict[str, list[float]] = {"base": [], "base_b": [], "gpulens": []}
        deadline = time.monotonic() + args.budget_s
        while len(arms["base"]) < 40:
            order = list(arms)
            rng.shuffle(order)
            for arm in order:
                if arm == "gpulens":
                    with gpulens.Monitor(interval=0.1, sinks=[
                            f"jsonl:{out / 'overhead.jsonl'}"]) as mon:
                        t = steps(model, args.steps, mon)
                else:
                    t = steps(model, args.steps)
                worst = torch.tensor([t], device=dev)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the slowest rank's step
                arms[arm].append(float(worst.item()))
            done = torch.tensor([time.monotonic() >= deadline], device=dev, dtype=torch.int)
            dist.all_reduce(done, op=dist.ReduceOp.MAX)  # every rank stops at the same round
            if done.item():
                break
        results["arms"] = arms
    else:  # nvlink
        results["configs"] = []
        for size in ("small", "large"):
            for bucket in (1.0, 100.0):
                model, params = make(size, bucket)
                steps(model, 10)
                path = out / f"nvlink-{size}-b{int(bucket)}.jsonl"
                with gpulens.Monitor(interval=0.05, sinks=[f"jsonl:{path}"]) as mon:
                    t = steps(model, args.steps, mon)
                results["configs"].append({"size": size, "bucket_cap_mb": bucket,
                                           "params": params, "step_s": t,
                                           "jsonl": path.name})
                del model
                if cuda:
                    torch.cuda.empty_cache()
    (out / f"loop-rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------------
class Log:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, text: str) -> None:
        print(text, flush=True)
        self.parts.append(text)


def torchrun(args: list[str], nproc: int, limit: float, log: Log, env: dict[str, str]
             ) -> tuple[int | None, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), *args]
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = None
        f.seek(0)
        tail = f.read()[-3000:]
    seconds = time.monotonic() - t0
    log.add(f"$ {' '.join(cmd)}\n-> exit {code} after {seconds:.1f} s\n{tail}\n")
    return code, seconds


def rows_of(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    start, rows = None, []
    for line in path.read_text().splitlines():
        obj = json.loads(line)
        if obj.get("event") == "run_start":
            start = obj
        elif "event" not in obj:
            rows.append(obj)
    return start, rows


def check_record(folder: Path, gpus: int) -> dict[str, Any]:
    records = sorted(folder.rglob("*.jsonl"))
    out: dict[str, Any] = {"records": [str(p.relative_to(folder)) for p in records]}
    if len(records) != 1:
        out["ok"] = False
        return out
    start, rows = rows_of(records[0])
    placed = [(g.get("rank"), g.get("node"), g.get("node_name")) for g in
              (start or {}).get("gpus", [])]
    out.update(
        rows=len(rows),
        every_gpu=all(all(f"gpu/{i}/util_pct" in r for i in range(gpus)) for r in rows),
        job_ranks=sorted({r.get("job/ranks") for r in rows}),
        run_start_gpus=len(placed), distinct_uuids=len({g.get("uuid") for g in
                                                        (start or {}).get("gpus", [])}),
        placed=placed,
    )
    out["ok"] = bool(rows) and out["every_gpu"] and out["job_ranks"] == [gpus] and (
        out["distinct_uuids"] == gpus and all(n is not None for _, n, _ in placed))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=510.0, help="all parts together")
    p.add_argument("--runs", type=int, default=5, help="launches of each example")
    p.add_argument("--steps", type=int, default=50, help="loop steps a round / config")
    p.add_argument("--size-for-overhead", default="small", choices=list(SIZES))
    p.add_argument("--cpu", action="store_true",
                   help="a smoke run on CPUs (gloo, simulated GPUs, tiny models): no figures")
    p.add_argument("--part", default="", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part:
        loop_main(args)
        return 0
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="scale-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="scale-gpu-work-"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    if args.cpu:
        env.update(GPULENS_BACKEND="simulated", GPULENS_SIMULATED_GPUS=str(args.gpus),
                   OMP_NUM_THREADS="1")
        SIZES.update(CPU_SIZES)
    start = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - start)  # noqa: E731
    log = Log()
    summary: dict[str, Any] = {"gpus": args.gpus, "runs": []}
    # 1. the examples, 5 launches each, alternating
    for k in range(args.runs):
        for example in ("hf", "lightning"):
            if left() < 200:
                log.add(f"runs: stopped before {example} #{k} (budget)")
                break
            folder = work / f"{example}-{k}"
            if example == "hf":
                cmd = [str(EXAMPLES / "hf_trainer.py"), "--output-dir", str(folder),
                       "--max-steps", "20", "--logging-steps", "2"]
            else:
                cmd = [str(EXAMPLES / "lightning_fit.py"), "--save-dir", str(folder),
                       "--max-steps", "20", "--log-every", "2", "--sink",
                       f"jsonl:{folder / 'gpulens.jsonl'}"]
            code, seconds = torchrun(cmd, args.gpus, min(90.0, left()), log, env)
            check = check_record(folder, args.gpus) if folder.exists() else {"ok": False}
            summary["runs"].append({"example": example, "k": k, "exit": code,
                                    "seconds": round(seconds, 1), **check})
    # 2. overhead, 3. NVLink
    for part, share in (("overhead", 0.5), ("nvlink", 1.0)):
        budget = max(30.0, (left() - 20) * share)
        folder = work / part
        folder.mkdir(exist_ok=True)
        code, _ = torchrun([str(Path(__file__).resolve()), "--part", part, "--run-dir",
                            str(folder), "--steps", str(args.steps), "--budget-s",
                            str(budget * 0.6), "--size-for-overhead", args.size_for_overhead,
                            *(["--cpu"] if args.cpu else [])],
                           args.gpus, budget, log, env)
        got = folder / "loop-rank0.json"
        summary[part] = json.loads(got.read_text()) if got.exists() else {"exit": code}
        summary[part]["exit"] = code
    if isinstance(summary.get("nvlink"), dict):
        for c in summary["nvlink"].get("configs", []):
            _, rows = rows_of(work / "nvlink" / c["jsonl"])
            per_gpu = []
            for r in rows[2:]:
                for i in range(args.gpus):
                    rx = r.get(f"gpu/{i}/nvlink_rx_gb_per_s")
                    tx = r.get(f"gpu/{i}/nvlink_tx_gb_per_s")
                    st = r.get("perf/step_time_s")
                    if rx is not None and tx is not None and st:
                        per_gpu.append((rx + tx) * 1e9 * st)
            c["nvlink_bytes_per_step_per_gpu"] = statistics.median(per_gpu) if per_gpu else None
            w = args.gpus
            c["ring_bytes_per_step_per_gpu"] = 2 * (w - 1) / w * c["params"] * 4 * 2  # rx + tx
            pcie = [r.get("gpu/0/pcie_rx_gb_per_s") for r in rows[2:]]
            c["pcie_rx_gb_per_s_gpu0"] = statistics.median([x for x in pcie if x is not None]) \
                if any(x is not None for x in pcie) else None
    summary["seconds"] = round(time.monotonic() - start, 1)
    (out / "scale_gpu.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "runs.log").write_text("\n".join(log.parts))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in work.rglob("*.jsonl"):
            tar.add(path, arcname=str(path.relative_to(work)))
    (out / "rows.tar.gz").write_bytes(buf.getvalue())
    md = markdown(summary)
    (out / "scale_gpu.md").write_text(md)
    print(md)
    return 0


def markdown(s: dict[str, Any]) -> str:
    lines = [f"# scale_gpu: {s['gpus']} GPUs, {s['seconds']} s", "",
             "## Runs (one writer, every rank's GPU, topology, no hang)", "",
             "| example | # | exit | s | rows | every GPU | job/ranks | run_start GPUs | "
             "distinct UUIDs | records | ok |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["runs"]:
        lines.append(f"| {r['example']} | {r['k']} | {r['exit']} | {r['seconds']} | "
                     f"{r.get('rows')} | {r.get('every_gpu')} | {r.get('job_ranks')} | "
                     f"{r.get('run_start_gpus')} | {r.get('distinct_uuids')} | "
                     f"{len(r.get('records', []))} | {r.get('ok')} |")
    hung = sum(r["exit"] is None for r in s["runs"])
    lines += ["", f"Hung: {hung} of {len(s['runs'])}; ok: "
              f"{sum(bool(r.get('ok')) for r in s['runs'])} of {len(s['runs'])}.", ""]
    arms = s.get("overhead", {}).get("arms")
    lines += ["## Overhead (slowest rank's mean step, rounds in shuffled order)", ""]
    if arms and arms.get("base"):
        base = statistics.median(arms["base"])
        aa = [abs(b - a) / a * 100 for a, b in zip(arms["base"], arms["base_b"], strict=False)]
        gl = [(g - a) / a * 100 for a, g in zip(arms["base"], arms["gpulens"], strict=False)]
        lines += [f"rounds {len(arms['base'])}; base step {base * 1e3:.3f} ms; gpulens - base "
                  f"median {statistics.median(gl):+.2f} % (rounds: "
                  f"{', '.join(f'{x:+.1f}' for x in gl)}); A/A |base_b - base| median "
                  f"{statistics.median(aa):.2f} %, max {max(aa):.2f} %. Verdict: "
                  + ("not separable from A/A" if abs(statistics.median(gl)) <= max(aa)
                     else "outside the A/A spread"), ""]
    else:
        lines += [f"no figures ({s.get('overhead')})", ""]
    lines += ["## NVLink bytes per step per GPU against the gradient bytes exchanged", "",
              "| model | params | bucket_cap_mb | step ms | NVLink rx+tx B/step/GPU | ring "
              "all-reduce rx+tx B/step/GPU | ratio | PCIe rx GB/s GPU 0 |",
              "|---|---|---|---|---|---|---|---|"]
    for c in s.get("nvlink", {}).get("configs", []):
        nv, ring = c.get("nvlink_bytes_per_step_per_gpu"), c["ring_bytes_per_step_per_gpu"]
        ratio = f"{nv / ring:.2f}" if nv is not None else "-"
        lines.append(f"| {c['size']} | {c['params']:,} | {c['bucket_cap_mb']:g} | "
                     f"{c['step_s'] * 1e3:.2f} | {nv if nv is None else f'{nv:,.0f}'} | "
                     f"{ring:,.0f} | {ratio} | {c.get('pcie_rx_gb_per_s_gpu0')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
