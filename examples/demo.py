"""gpulens demo: a short real training with GPU telemetry beside the loss, in three trackers.

Trains a small GPT-2 (built from a config in code, random tokens, no downloads) for a few
seconds and logs every step, with the tokens it took, through ``gpulens.Monitor`` to

* an MLflow store on local disk   (demo-output/mlflow.db),
* an offline W&B run              (demo-output/wandb/offline-run-*),
* a JSONL record                  (demo-output/gpu.jsonl),

then writes an HTML report.  Real GPUs are used when NVML answers; otherwise the GPUs are
simulated (and the demo says so): the training itself then runs on the CPU, and its MFU is
against a simulated H100's peak (so tiny).

    make demo            # or: .venv/bin/python examples/demo.py [--steps 120] [--out DIR]
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import time
from pathlib import Path


def _nvml_answers() -> bool:
    from gpulens.errors import NvmlUnavailable
    from gpulens.sources.nvml import NvmlSource

    source = NvmlSource()
    try:
        source.open()
    except NvmlUnavailable:
        return False
    try:
        return source.device_count() > 0
    finally:
        source.close()


def shown(path: Path) -> str:
    """``path`` as the user would type it here: relative to the current folder when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
    ap.add_argument("--out", default="demo-output", help="output folder (default demo-output)")
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between GPU samples")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be at least 1")

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    real_gpus = _nvml_answers()
    backend: object = None  # NVML
    if not real_gpus:
        from gpulens.testing import SimulatedNVML, Wave

        # busy simulated GPUs (their load does not follow the CPU training)
        backend = SimulatedNVML(gpus=2, load=Wave(mean=0.8, amplitude=0.15))
        print("No NVIDIA driver answered: using 2 SIMULATED GPUs (the training runs on the CPU).")
    # Trackers on local disk only: an offline W&B run and an MLflow store in a file.
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_CONSOLE", "off")
    os.environ["WANDB_DIR"] = str(out)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

    import logging

    import mlflow
    import torch
    import wandb

    for name in ("mlflow", "alembic"):  # their database set-up chatter, not the demo's
        logging.getLogger(name).setLevel(logging.WARNING)
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel

    import gpulens
    from gpulens.work.hf import model_flops

    torch.manual_seed(0)
    device = "cuda" if real_gpus and torch.cuda.is_available() else "cpu"
    vocab, width, seq, batch = 512, 128, 64, 16
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=width, n_layer=2, n_head=4,
                                       n_positions=seq, bos_token_id=vocab - 1,
                                       eos_token_id=vocab - 1)).to(device)
    formula = model_flops(model)  # analytic, from the config: forward + backward per token
    flops_per_token = formula.flops_per_token(seq) if formula is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps)
    # a learnable pattern: each token predicts the next in a fixed random permutation
    perm = torch.randperm(vocab, device=device)

    mlflow_uri = f"sqlite:///{out / 'mlflow.db'}"
    mlflow.set_tracking_uri(mlflow_uri)
    mlflow.set_experiment("gpulens-demo")
    jsonl = out / "gpu.jsonl"
    run = wandb.init(project="gpulens-demo", config={"steps": args.steps, "device": device})
    started = time.time()
    with mlflow.start_run(run_name="gpulens-demo") as mlrun, gpulens.Monitor(
        interval=args.interval, sinks=["wandb", "mlflow", f"jsonl:{shown(jsonl)}"], backend=backend,
        dtype="fp32", flops_per_token=flops_per_token,
    ) as mon:
        assert mon.context is not None
        gpus = ", ".join(f"{g.index}: {g.name}" for g in mon.context.gpus) or "none"
        print(f"Monitoring {len(mon.context.gpus)} GPU(s) via {mon.context.backend} [{gpus}]")
        for step in range(1, args.steps + 1):
            x = torch.randint(0, vocab, (batch, seq), device=device)
            y = perm[x]
            logits = model(input_ids=x).logits
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 10 == 0 or step == 1:
                print(f"  step {step:4d}  loss {loss.item():.3f}")
            mon.log(step, tokens=batch * seq, loss=loss.detach(),
                    learning_rate=sched.get_last_lr()[0], grad_norm=grad_norm.detach())
        stats = mon.stop()
    wandb_run_dir = Path(run.dir).parent
    wandb.finish()
    took = time.time() - started

    # gpu.jsonl keeps every demo run (the jsonl sink appends); this one is the last run
    from gpulens.report import load_jsonl
    from gpulens.report.text import sized

    record = load_jsonl(jsonl)
    rows = [{"step": r.step, **r.values} for r in record.rows]
    report = out / "report.html"
    from gpulens.cli import main as cli_main

    cli_main(["report", shown(jsonl), "-o", shown(report)])

    last = rows[-1]
    gpu_ids = sorted({k.split("/")[1] for k in last if k.startswith("gpu/") and
                      k.split("/")[1].isdigit()})
    print(f"\nTrained {args.steps} steps in {took:.1f} s; {len(rows)} rows written "
          f"({', '.join(f'{n}: {s.written} rows' for n, s in stats.items())}).")
    print(f"Last row (step {last['step']}), window of {last['perf/step_time_s'] * 1e3:.0f} ms "
          f"(memory in GB of 10^9 bytes; {record.backend} GPUs):")
    print(f"  train/loss {last['train/loss']:.3f}  train/learning_rate "
          f"{last['train/learning_rate']:.2e}  train/grad_norm {last['train/grad_norm']:.3f}")
    for gid in gpu_ids:
        def g(key: str, fmt: str = ".1f", gid: str = gid) -> str:
            value = last.get(f"gpu/{gid}/{key}")
            return "n/a" if value is None or math.isnan(value) else format(value, fmt)
        print(f"  gpu/{gid}: sm_active {g('sm_active_pct')} %  util {g('util_pct')} %  "
              f"mem {g('mem_used_gb', '.2f')} GB  power {g('power_w')} W  "
              f"energy {g('energy_j', '.2f')} J  temp {g('temp_c')} C")
    total_j = sum(r.get("perf/energy_per_step_j") or 0.0 for r in rows)
    print(f"  energy for the whole run: {total_j:.0f} J ({total_j / 3600:.3f} Wh)")
    if "perf/tokens_per_s" in last:
        mfu, tflops = last.get("perf/mfu_pct"), last.get("perf/tflops")
        print(f"  throughput {last['perf/tokens_per_s']:.0f} tokens/s  "
              f"{'n/a' if tflops is None else sized(tflops)} TFLOP/s per GPU  "
              f"MFU {'n/a' if mfu is None else sized(mfu)} % of "
              f"{record.meta.get('peak_tflops', 'n/a')} TFLOP/s "
              f"({record.meta.get('peak_gpu', 'no peak')}, {record.meta.get('peak_dtype', '?')})")
    for e in record.events:
        if e.kind == "alert":
            print(f"  advice at step {e.step}: {e.name} {e.state}: {e.message}")
    offline = sorted(glob.glob(str(wandb_run_dir)))
    print("\nWhere the results are:")
    print(f"  JSONL record : {shown(jsonl)}   (run {record.selected[0].run_id}; "
          f"{len(record.runs)} run(s) in the file)")
    print(f"  HTML report  : {shown(report)}   (open it in a browser)")
    print(f"  MLflow       : run {mlrun.info.run_id} in {shown(out / 'mlflow.db')}")
    print(f"                 open: .venv/bin/mlflow ui --backend-store-uri "
          f"sqlite:///{shown(out / 'mlflow.db')}")
    print(f"  W&B offline  : {shown(Path(offline[0]) if offline else wandb_run_dir)}")
    print(f"                 upload: .venv/bin/wandb sync {shown(wandb_run_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
